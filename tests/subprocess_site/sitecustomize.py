"""Imported at the start of every Python process the CPU tests start (conftest puts this folder on PYTHONPATH):
inductor's vector-ISA probes answered from the test process's own answers (THUNDER_TK_TEST_ISA_PROBES, a JSON file).

Before its first CPU compile, inductor checks each ISA the CPU reports by building a kernel and loading it in a
fresh Python that imports torch: six such processes on an AVX-512/AMX CPU, about 8 s a process. TORCHINDUCTOR_VEC_ISA_OK
skips only the base check, not those of AVX-512 bf16, VNNI and AMX. Each torchrun rank and `thunder-tk pretrain` run of
the suite paid them. A probe whose answer is not in the file (another CPU, another torch) runs as usual."""

import os
import sys

_ANSWERS = os.environ.get("THUNDER_TK_TEST_ISA_PROBES")
_MODULE = "torch._inductor.cpu_vec_isa"


def probe_key(isa, code: str) -> str:
    """What a probe depends on: the ISA, its compile flags at the time (the subclasses add theirs) and the code."""
    import hashlib

    return f"{isa}|{isa._arch_flags}|{hashlib.sha256(code.encode()).hexdigest()[:16]}"


def _answer_from_file(module) -> None:
    import json

    try:
        with open(_ANSWERS) as f:
            answers = json.load(f)
    except (OSError, ValueError):
        return
    probe = module.VecISA.check_build

    def check_build(self, code):
        answer = answers.get(probe_key(self, code))
        return answer if isinstance(answer, bool) else probe(self, code)

    module.VecISA.check_build = check_build


class _PatchWhenLoaded:
    """A meta-path finder that lets the module load as usual and patches it right after (torch is not imported here:
    some of the processes never import it)."""

    def find_spec(self, name, path=None, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            try:
                _answer_from_file(module)
            except Exception:  # another torch's layout: its probes run as usual
                pass

        spec.loader.exec_module = exec_module
        return spec


if _ANSWERS and _MODULE not in sys.modules:
    sys.meta_path.insert(0, _PatchWhenLoaded())
