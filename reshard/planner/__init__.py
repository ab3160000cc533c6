"""What moves: compile two layouts into a verified, accounted plan; predict how long it takes."""
from .accounting import Accounting, Bounds
from .compiler import compile_plan
from .cost import ClusterModel, Prediction, compare_with_measurement, format_prediction, predict
from .plan import OP_COLUMNS, Plan, TensorTable, Transfer
from .program import Program

compile = compile_plan  # noqa: A001 - the public verb: reshard.compile(src, dst)

__all__ = ["Accounting", "Bounds", "ClusterModel", "OP_COLUMNS", "Plan", "Prediction", "Program", "TensorTable",
           "Transfer", "compare_with_measurement", "compile", "compile_plan", "format_prediction", "predict"]
