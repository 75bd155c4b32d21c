"""A chat's tool fields as a :class:`~.tool_format.ToolPlan`: which tools the prompt offers,
whether and which call is forced, the family syntax calls are written in, and what a forced call
is pre-filled with and held to. The fields themselves (names, schemas, the choice naming an
offered tool) were checked when the request was parsed (:mod:`..openai.chat_protocol`)."""

from __future__ import annotations

from superfluid.core.formats.forced import forced_call

from .tool_format import ToolPlan


def plan(req, fmt=None, grammars: bool = False, opened: str = "") -> ToolPlan:
    """The plan of a chat request (:class:`~..openai.chat_protocol.ChatFields`) whose replies
    are written in ``fmt`` (a ToolFormat; None: calls are not read). ``grammars``: the engine
    can constrain sampling, so a forced call carries its schema. ``opened``: the end marker of a
    reasoning span the prompt opened, which a forced call's pre-fill closes first."""
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
    parallel = req.parallel_tool_calls is not False
    base = ToolPlan(tools=tools, choice=choice, name=name, parallel=parallel, fmt=fmt)
    if not base.forced:
        return base
    functions = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == name]
    forced = forced_call(fmt, functions, grammars)
    prefill = (opened + "\n\n" if opened else "") + forced.prefill
    stop = forced.stop if (choice == "function" or not parallel) else ()
    return ToolPlan(tools=tools, choice=choice, name=name, parallel=parallel, fmt=fmt, prefill=prefill,
                    constraint=forced.constraint, stop=stop)
