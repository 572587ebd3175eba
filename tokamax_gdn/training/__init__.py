"""Training the decoder: the recall task, the AdamW step, the run, and the
profiled split of a step's time. Needs optax (`pip install 'tokamax_gdn[flax]'`)."""

from tokamax_gdn.training.data import RecallTask
from tokamax_gdn.training.loop import TrainConfig, TrainResult, evaluate, train  # pylint: disable=g-multiple-import
from tokamax_gdn.training.step import StepConfig, loss_fn, make_optimizer, make_train_step, train_step  # pylint: disable=g-multiple-import

__all__ = ["RecallTask", "StepConfig", "TrainConfig", "TrainResult", "evaluate", "loss_fn",
           "make_optimizer", "make_train_step", "train", "train_step"]
