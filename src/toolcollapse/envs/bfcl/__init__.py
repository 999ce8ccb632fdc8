"""BFCL v4 multi-turn (the `bfcl-eval` package's data and executable backends) as an environment.

    data.py      entries of the multi-turn categories, the seeded train/test split
    schema.py    BFCL function docs -> ToolSpec with valid JSON schema
    calls.py     ground-truth call strings parsed with `ast`, literals only
    backend.py   backend instances, allow-listed dispatch, BFCL's result serialisation
    checker.py   BFCL's per-turn state and execution-response check, reimplemented
    prompts.py   system prompt (BFCL instructions + Qwen tools block), fixed texts
    tasks.py     entries -> Task (prompt, tools per turn, reference trajectory)
    env.py       the Environment
"""

from toolcollapse.envs.bfcl.env import BFCL, Progress

__all__ = ["BFCL", "Progress"]
