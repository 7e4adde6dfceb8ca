"""``import zerokit`` is light (issue 33): it imports neither ``torch._dynamo`` (about 1 s and
70 MiB on every rank; zerokit's hooks are decorated for ``torch.compile`` at their first call)
nor a trainer, transformers, DCP or the command-line tools. Counted in a fresh process, so
what this test process imported does not hide anything."""

import json
import subprocess
import sys

import pytest

_MODULES = "import sys; {imports}; print(json.dumps(sorted(sys.modules)))"


def _modules(imports: str) -> set[str]:
    code = "import json; " + _MODULES.format(imports=imports)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.fixture(scope="module")
def added() -> set[str]:
    """The modules ``import zerokit`` adds to ``import torch``."""
    return _modules("import torch; import zerokit") - _modules("import torch")


@pytest.mark.parametrize(
    "heavy",
    ["torch._dynamo", "lightning", "transformers", "torch.distributed.checkpoint", "zerokit.tools"],
)
def test_import_zerokit_leaves_out(added, heavy):
    found = sorted(m for m in added if m == heavy or m.startswith(heavy + "."))
    assert not found, f"import zerokit imports {heavy}: {found[:5]}"


def test_import_zerokit_adds_few_modules_besides_its_own(added):
    # zerokit's own modules are what it is; besides them it needs the standard library's few
    # modules torch does not import and safetensors (3 modules: the checkpoint format): 5 today.
    # torch._dynamo alone brings about 830 (sympy's 420 among them), lightning or
    # transformers hundreds, so 20 leaves room for a small new dependency and none for those.
    others = sorted(m for m in added if m != "zerokit" and not m.startswith("zerokit."))
    assert len(others) <= 20, others
