import subprocess
import sys


def test_planning_imports_no_torch_hivemind_or_asyncio():
    code = (
        "import sys, p2ptrain.planning, p2ptrain.planning.report;"
        "bad = [m for m in ('torch', 'hivemind', 'asyncio') if m in sys.modules];"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
