"""System prompt and fixed texts of the BFCL environment.

The tools block is the tool world's `qwen` style (Qwen2.5's own tool prompt); the
instructions in front of it are BFCL's "classic" system prompt
(`constants/default_prompts.py::PROMPT_STYLE_TEMPLATES`, task and multi-turn
behaviour), without its Python-list output format -- calls use Qwen's <tool_call>
tags, one per assistant turn -- and without the tool world's "The answer is" rule:
BFCL judges the state, not a final text.

BFCL has no ground-truth text, so each reference turn ends with a short fixed reply
(`closing_text`): what was done, or, when the turn's ground truth is empty, why
nothing could be done (a missing function, or a clarification question for a
missing parameter).
"""

from __future__ import annotations

import json
from typing import Sequence

from toolcollapse.envs.toolworld.prompts import system_prompt as toolworld_prompt
from toolcollapse.tools import ToolSpec

INSTRUCTIONS = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, point it out. If the given question lacks the parameters required "
    "by the function, also point it out.\n\n"
    "At each turn, you should try your best to complete the tasks requested by the user within the current "
    "turn. Continue to output functions to call until you have fulfilled the user's request to the best of "
    "your ability. Once you have no more functions to call, the system will consider the current turn "
    "complete and proceed to the next turn or task.\n\n"
    "Call one function per message and wait for its result. When the request is done, or cannot be done, "
    "reply to the user in plain text, without a function call."
)
# BFCL's DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_FC, the user turn that reveals held-out functions
ADDED_FUNCTIONS_TEXT = "I have updated some more functions you can choose from. What about now?"
_TOOLS_HEADING = "# Tools"


def system_prompt(tools: Sequence[ToolSpec]) -> str:
    """BFCL's instructions, then the `qwen` style's tools block."""
    qwen = toolworld_prompt(tools, "qwen")
    return INSTRUCTIONS + "\n\n" + qwen[qwen.index(_TOOLS_HEADING):]


def added_functions_text(tools: Sequence[ToolSpec]) -> str:
    """The user turn of a miss_func entry that reveals `tools`: their docs as in the system
    prompt, then BFCL's sentence (BFCL's prompting handlers put the docs first too)."""
    docs = "\n".join(json.dumps(t.to_doc(), ensure_ascii=False) for t in tools)
    return f"<tools>\n{docs}\n</tools>\n{ADDED_FUNCTIONS_TEXT}"


def closing_text(called: Sequence[str], missing_function: bool, category: str) -> str:
    """The reference's reply ending a user turn, after the calls named in `called`."""
    if called:
        names = ", ".join(dict.fromkeys(called))
        return f"Done. I used {names} for this request."
    if missing_function:
        return "None of the available functions can do this, so I cannot complete this request yet."
    if category == "miss_param":
        return "I need more information to do this. Could you give me the missing details?"
    return "I cannot do this with the available functions."
