"""Pipeline parallelism: the stage cut (`partition`, `cuts`, `owners`), the stages built from the user's model
(`stages`, `split`, `shadow`, `sides`, `tied`), and the schedules that run them (`schedule`, `trace`)."""

from lightning_par.parallel.pipeline.partition import partition
from lightning_par.parallel.pipeline.schedule import SCHEDULES
from lightning_par.parallel.pipeline.split import PipelineSplit, split_pipeline

__all__ = ["SCHEDULES", "PipelineSplit", "partition", "split_pipeline"]
