"""The sample generation at each eval and at the end of training stays within the model's positions."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from transformers import AutoConfig, AutoModelForCausalLM

from lmpretrain.observe import generate_sample


def test_sample_stops_at_the_last_learned_position(small_tokenizer):
    # GPT-2's positions are an embedding table: token 17 of a 16-position model has no row (IndexError).
    config = AutoConfig.for_model(
        "gpt2", vocab_size=len(small_tokenizer), n_positions=16, n_embd=16, n_layer=1, n_head=2
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    prompt = "def add(a, b):"
    prompt_ids = small_tokenizer(prompt, add_special_tokens=False).input_ids
    assert 0 < len(prompt_ids) < 16
    text = generate_sample(model, small_tokenizer, prompt, 48, Accelerator(cpu=True))
    ids = small_tokenizer(text, add_special_tokens=False).input_ids
    assert text.startswith(prompt) and len(ids) <= 16
    assert len(small_tokenizer.decode(ids)) > len(prompt)  # it did generate, up to the last position
