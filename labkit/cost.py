"""What generating text costs: tokens processed, FLOPs and bytes, naive against cached.

Tokens processed for a prompt of P tokens and N new ones (the last new token is sampled, never
fed back, so only N - 1 of them go through the model):

    naive  = P + (P + 1) + ... + (P + N - 1) = N*P + N(N - 1)/2      (quadratic in N)
    cached = P (prefill) + (N - 1) (one token per decode step)      (linear in N)

FLOPs of one forward pass that runs T new tokens after C tokens already in the cache:

    2 x (matmul weights) x T          every weight is multiplied once per token
  + 4 x layers x d_model x sum over the T queries of the keys each attends to
                                      (q.k scores and the weighted sum of values, 2 FLOPs each)

Bytes a forward pass moves, at the least: every matmul weight once, the cached keys and values
read back, and the new ones written.
Arithmetic intensity is FLOPs over bytes: about 2 / bytes-per-weight for a decode step, far
left of any machine's ridge point, so decoding is bound by memory bandwidth.
"""
from __future__ import annotations

from labkit.answers import answer_to
from labkit.memory import kv_bytes_per_token, shape_of
from labkit.model import ModelConfig


@answer_to("ex01.1")
def tokens_processed(prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """Tokens run through the model to generate ``new_tokens``: (naive, cached)."""
    if prompt_len < 1 or new_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len} and new_tokens={new_tokens} must both be at least 1")
    naive = new_tokens * prompt_len + new_tokens * (new_tokens - 1) // 2
    return naive, prompt_len + new_tokens - 1


def matmul_weights(config: ModelConfig) -> int:
    """Weights that multiply every token: attention and MLP projections, and the LM head
    (the embedding is a lookup, not a matmul)."""
    per_layer = config.d_model * (config.n_heads + 2 * config.n_kv_heads) * config.head_dim \
        + config.d_model * config.d_model + 3 * config.d_model * config.d_ff
    return config.n_layers * per_layer + config.d_model * config.vocab_size


def attention_flops(n_layers: int, n_heads: int, head_dim: int, tokens: int, cached: int = 0) -> float:
    """FLOPs of attention for ``tokens`` new queries after ``cached`` tokens in the cache: the
    q.k scores and the weighted sum of values, 2 FLOPs each per key, in every head and layer."""
    keys_attended = tokens * cached + tokens * (tokens + 1) / 2  # query i sees cached + i + 1 keys
    return 4 * n_layers * n_heads * head_dim * keys_attended


def forward_flops(config: ModelConfig, tokens: int, cached: int = 0) -> float:
    """FLOPs of one forward pass of ``tokens`` new tokens after ``cached`` tokens in the cache."""
    if tokens < 0 or cached < 0:
        raise ValueError(f"tokens={tokens} and cached={cached} must be 0 or more")
    attention = attention_flops(config.n_layers, config.n_heads, config.head_dim, tokens, cached)
    return 2 * matmul_weights(config) * tokens + attention


def generation_flops(config: ModelConfig, prompt_len: int, new_tokens: int) -> tuple[float, float]:
    """FLOPs to generate ``new_tokens`` after a prompt: (naive, cached)."""
    tokens_processed(prompt_len, new_tokens)  # validates
    naive = sum(forward_flops(config, prompt_len + step) for step in range(new_tokens))
    cached = forward_flops(config, prompt_len) + sum(
        forward_flops(config, 1, prompt_len + step) for step in range(new_tokens - 1))
    return naive, cached


def forward_bytes(config: ModelConfig, tokens: int, cached: int = 0, weight_bytes: float = 2,
                  kv_dtype: str = "fp16") -> float:
    """Bytes one forward pass moves, at the least: every matmul weight once (``weight_bytes``
    each), the keys and values of ``cached`` tokens read back and those of ``tokens`` written.
    Activations are left out: for a decode step they are tiny next to the weights."""
    kv = kv_bytes_per_token(shape_of("model", config, matmul_weights(config)), kv_dtype)
    return matmul_weights(config) * weight_bytes + kv * (cached + tokens)


def intensity(config: ModelConfig, tokens: int, cached: int = 0, weight_bytes: float = 2,
              kv_dtype: str = "fp16") -> float:
    """Arithmetic intensity (FLOP per byte) of one forward pass."""
    return forward_flops(config, tokens, cached) / forward_bytes(config, tokens, cached, weight_bytes, kv_dtype)
