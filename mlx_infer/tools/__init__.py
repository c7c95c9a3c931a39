"""Tool calls: OpenAI function tools checked (spec), shown to the model through its chat template or the
generic form (formats), constrained by a call grammar (grammar) and read back from the text (parse); plan_tools
puts a request's together (plan)."""

from .formats import GENERIC, ToolFormat
from .parse import ToolEvent, ToolStream
from .plan import ToolPlan, plan_tools

__all__ = ["GENERIC", "ToolEvent", "ToolFormat", "ToolPlan", "ToolStream", "plan_tools"]
