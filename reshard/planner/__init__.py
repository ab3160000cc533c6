"""What moves: compile two layouts into a verified, accounted plan."""
from .accounting import Accounting, Bounds
from .compiler import compile_plan
from .plan import OP_COLUMNS, Plan, TensorTable, Transfer

compile = compile_plan  # noqa: A001 - the public verb: reshard.compile(src, dst)

__all__ = ["Accounting", "Bounds", "OP_COLUMNS", "Plan", "TensorTable", "Transfer", "compile", "compile_plan"]
