"""Fixtures shared by the integration tests: the Hugging Face twin of the default model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_model(loaded_model):
    """transformers' LlamaForCausalLM on the session's weights (fp32, eval), built once for
    every file that compares with it (logprobs, pooled hidden states). Tests only read it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    try:  # transformers 5
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4
        from transformers.modeling_utils import no_init_weights  # type: ignore[no-redef]

    c = loaded_model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    # No random initialization: every weight is overwritten just below (the output layer is
    # tied to the embeddings), and initializing 135M parameters cost seconds for nothing.
    with no_init_weights():
        model = LlamaForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(loaded_model.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model
