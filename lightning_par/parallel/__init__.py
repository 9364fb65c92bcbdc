"""Pure-torch parallel transforms, one file per technique; nothing here imports Lightning."""
