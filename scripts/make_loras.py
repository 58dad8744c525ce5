"""Make LoRA adapters of the starter model for the engine tests (tests/engines/).

    $LLMGW_ENGINES_DIR/vllm/bin/python scripts/make_loras.py MODEL_DIR OUT_DIR NAME...

Each NAME becomes OUT_DIR/NAME, a PEFT adapter directory (adapter_config.json
and adapter_model.safetensors) of rank 8 on the attention projections, as
vLLM loads with ``--enable-lora --max-lora-rank 8``. PEFT starts an adapter
as a no-op (its B matrices are zero): these are drawn at random instead
(``init_lora_weights=False``), seeded by the name, and scaled so that each
adapter's greedy answers differ from the base's and from each other's, which
is all the tests need of a fine-tune. Nothing is downloaded: the model is the
local directory scripts/engines.sh made. Seconds on a CPU.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path


def make(model_dir: Path, out: Path, name: str) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for param_name, param in peft_model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0.0, 0.05)
    target = out / name
    peft_model.save_pretrained(target)
    print(f"make_loras: {name} -> {target}")


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    model_dir, out = Path(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name in argv[2:]:
        make(model_dir, out, name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
