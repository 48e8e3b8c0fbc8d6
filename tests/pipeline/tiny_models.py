"""Small random models of the two supported families (Nemotron-H, Llama), and a recipe, for the tests."""

import torch

# The default recipe with importance-weighted 4/6: a run under it reduces every kind of statistic
# (input and KV amax, exact x^2 sums and counts, tokens per expert).
IMPORTANCE_RECIPE = """\
name: lightning-importance
kv_cache: fp8
rules:
  - roles: [routed_experts, shared_experts]
    format: nvfp4_w4a16
    scale_rule: 4o6
    importance: true
  - roles: [mamba_in_proj, mamba_out_proj]
    format: fp8
"""


def nemotron_h_config(**overrides):
    from transformers import NemotronHConfig

    kw = dict(
        vocab_size=512,
        hidden_size=64,
        hybrid_override_pattern="ME*E",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_group=1,
        topk_group=1,
        intermediate_size=96,
        tie_word_embeddings=False,
        max_position_embeddings=256,
    )
    kw.update(overrides)
    return NemotronHConfig(**kw)


def build_nemotron_h(seed=0, **overrides):
    from transformers import NemotronHForCausalLM

    torch.manual_seed(seed)
    model = NemotronHForCausalLM(nemotron_h_config(**overrides)).to(torch.bfloat16).eval()
    with torch.no_grad():  # give the router a spread so every expert gets some tokens
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    return model


def build_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
