"""A chat's tool fields as a :class:`~.tool_format.ToolPlan`: which tools the prompt offers,
whether and which call is forced, and the constraint that holds a forced call to its tools'
schemas. The fields themselves (names, schemas, the choice naming an offered tool) were checked
when the request was parsed (:mod:`..openai.chat_protocol`)."""

from __future__ import annotations

from .tool_format import ToolPlan, forced_rest


def plan(req, grammars: bool = False) -> ToolPlan:
    """The plan of a chat request (:class:`~..openai.chat_protocol.ChatFields`). ``grammars``:
    the engine can constrain sampling, so a forced call carries its schema."""
    tools = tuple(tool.function.offered() for tool in req.tools or ())
    choice, name = req.tool_choice, None
    if choice is None:
        choice = "auto" if tools else "none"
    elif not isinstance(choice, str):
        choice, name = "function", choice.function.name
    elif not tools:
        choice = "none"
    if choice == "required" and len(tools) == 1:
        choice, name = "function", tools[0]["function"]["name"]  # one tool: required names it
    constraint = None
    if grammars and choice in ("function", "required"):
        constraint = forced_rest([t for t in tools if choice == "required" or t["function"]["name"] == name])
    return ToolPlan(tools=tools, choice=choice, name=name, parallel=req.parallel_tool_calls is not False,
                    constraint=constraint)
