"""What a newcomer meets first: the README's commands, CI running them, tests of optional extras."""

import pytest
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("gguf", "peft", "bfcl_eval", "pandas", "pyarrow")  # (mpmath comes with torch, via sympy)


def readme_commands() -> list[str]:
    block = re.search(r"^```(?:bash|sh|shell|console)\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    return [line.strip() for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_the_readme_starts_with_two_commands_and_ci_runs_the_second_verbatim():
    install_and_run, install_and_test = readme_commands()
    assert install_and_run.startswith("pip install torch==2.13.0 && ") and "toolcollapse " in install_and_run
    assert install_and_test.startswith("pip install torch==2.13.0 && ") and install_and_test.endswith("pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'README_TEST_COMMAND="{install_and_test}"' in ci and 'bash -c "$README_TEST_COMMAND"' in ci


@pytest.mark.slow
def test_tests_of_a_missing_extra_are_skipped_with_a_reason_not_collection_errors():
    """Collect the suite as if none of the optional packages were installed."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in OPTIONAL)  # `import m` then raises ImportError
    code = f"import sys, pytest; {blocked}; sys.exit(pytest.main(['--collect-only', '-q', '-rs', '-p', " \
           f"'no:cacheprovider', {str(ROOT / 'tests')!r}]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]  # a collection error exits 2
    skipped = re.findall(r"SKIPPED \[\d+\] ([^:\s]+):\d+: (.+)", out)
    files = {Path(f).name for f, _ in skipped}
    assert {"test_sources.py", "test_bfcl.py"} <= files, out[-3000:]
    assert all("pip install" in reason for _, reason in skipped), skipped
