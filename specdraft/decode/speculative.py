"""Batched speculative decoding with an EAGLE-3 draft: lossless, static shapes, per-row lengths.

Each round: the draft proposes G tokens after the pending token c; the policy verifies
[c, d_1..d_G] in one pass; rejection sampling accepts a prefix of a tokens and emits a correction
or bonus token c' (tau = a + 1 tokens per round). Both KV caches roll back by setting their
lengths. The draft then catches up on the verified positions with the policy's real features in
one (G+1)-wide pass whose entry a is already the next round's first proposal.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdraft.decode.rejection import rejection_sample
from specdraft.decode.sampling import Generation, probs_at, sample
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import EOS, PAD


def _logprob(logits_BV, tok_B):
  return jnp.take_along_axis(jax.nn.log_softmax(logits_BV.astype(jnp.float32)), tok_B[:, None], -1)[
    :, 0
  ]


@functools.partial(
  jax.jit, static_argnames=("pcfg", "dcfg", "max_new_tokens", "temperature", "num_draft", "sampler")
)
def generate(
  params,
  dparams,
  pcfg: pol.PolicyConfig,
  dcfg: eagle3.DraftConfig,
  prompt_BP,
  prompt_lengths_B,
  key,
  *,
  max_new_tokens: int,
  temperature: float,
  num_draft: int,
  sampler=rejection_sample,
) -> Generation:
  """Speculative generation; same interface and output as `autoregressive.generate`.

  `sampler` is the verification rule (tests swap in a broken one as a negative control).

  stats: policy_passes, draft_passes, rounds, tau_sum and row_rounds (tau = tau_sum/row_rounds),
  accept_counts[G] and reach_counts[G] (per-position conditional acceptance = accept/reach).
  """
  B, P = prompt_BP.shape
  N, G = max_new_tokens, num_draft
  cap = P + N + G + 2
  embed_table = params["embed"]
  rows = jnp.arange(B)

  # --- prefill: policy over the prompt, first token from the policy, draft over the prompt.
  pcache = pol.init_cache(pcfg, B, cap)
  logits, taps, pcache = pol.prefill(params, pcfg, pcache, prompt_BP, prompt_lengths_B)
  last = logits[rows, prompt_lengths_B - 1]
  key, sub = jax.random.split(key)
  c = sample(sub, last, temperature)
  out = jnp.full((B, N + G + 1), PAD, jnp.int32).at[:, 0].set(c)
  out_lp = jnp.zeros((B, N + G + 1), jnp.float32).at[:, 0].set(_logprob(last, c))
  out_len = jnp.ones((B,), jnp.int32)
  done = (c == EOS) | (out_len >= N)

  shifted = jnp.concatenate([prompt_BP[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
  d_tokens = jnp.where(jnp.arange(P)[None] == (prompt_lengths_B - 1)[:, None], c[:, None], shifted)
  dcache = eagle3.init_cache(dcfg, B, cap)
  d_logits, d_hidden, dcache = eagle3.step(
    dparams, dcfg, embed_table, dcache, eagle3.fuse(dparams, taps.layers, dcfg), d_tokens
  )
  q_logits = d_logits[rows, prompt_lengths_B - 1]
  h = d_hidden[rows, prompt_lengths_B - 1]
  dcache = dcache._replace(lengths=prompt_lengths_B.astype(jnp.int32))

  stats = {
    "policy_passes": jnp.int32(1),
    "draft_passes": jnp.int32(1),
    "rounds": jnp.int32(0),
    "tau_sum": jnp.int32(0),
    "row_rounds": jnp.int32(0),
    "accept_counts": jnp.zeros((G,), jnp.int32),
    "reach_counts": jnp.zeros((G,), jnp.int32),
  }

  def draft_tokens(key, q_logits, h, dcache):
    """G proposals: the first from the carried logits, then G-1 single-entry draft steps."""
    toks, probs = [], []
    keys = jax.random.split(key, G)
    for i in range(G):  # G is small and static; unrolled so the last step skips a draft pass
      tok = sample(keys[i], q_logits, temperature)
      toks.append(tok)
      probs.append(probs_at(q_logits, temperature))
      if i < G - 1:
        lg, hh, dcache = eagle3.step(dparams, dcfg, embed_table, dcache, h[:, None], tok[:, None])
        q_logits, h = lg[:, 0], hh[:, 0]
    return jnp.stack(toks, 1), jnp.stack(probs, 1), dcache

  def cond(carry):
    return ~jnp.all(carry["done"])

  def round_(carry):
    key, k_draft, k_rej = jax.random.split(carry["key"], 3)
    pcache, dcache, c = carry["pcache"], carry["dcache"], carry["c"]
    n = pcache.lengths
    active = ~carry["done"]
    d, q_probs, dcache = draft_tokens(k_draft, carry["q_logits"], carry["h"], dcache)

    # Verify [c, d_1..d_G] in one policy pass.
    logits, vtaps, pcache = pol.decode(params, pcfg, pcache, jnp.concatenate([c[:, None], d], 1))
    p_probs = probs_at(logits, temperature)
    toks, a = sampler(k_rej, d, None if temperature == 0 else q_probs, p_probs)
    c_new = toks[rows, a]
    lps = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.maximum(toks, 0)[..., None], -1)[
      ..., 0
    ]

    # Emit toks[0..a], cut at EOS and at the length limit; finished rows emit nothing.
    idx = jnp.arange(G + 1)[None]
    is_eos = (toks == EOS) & (idx <= a[:, None])
    first_eos = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1), G + 1)
    count = jnp.minimum(jnp.minimum(a + 1, first_eos + 1), N - carry["out_len"])
    count = jnp.where(active, count, 0)
    write = lambda buf, vals: jax.vmap(lambda b, v, s: jax.lax.dynamic_update_slice(b, v, (s,)))(
      buf, vals, carry["out_len"]
    )
    keep = idx < count[:, None]
    out = write(
      carry["out"],
      jnp.where(keep, toks, carry["out"][rows[:, None], carry["out_len"][:, None] + idx]),
    )
    out_lp = write(carry["out_lp"], jnp.where(keep, lps, 0.0))
    out_len = carry["out_len"] + count
    done = carry["done"] | (first_eos <= a) | (out_len >= N)

    # Roll back both caches to the verified prefix [.., c, d_1..d_a]; draft catches up.
    new_n = jnp.where(active, n + a + 1, n)
    pcache = pcache._replace(lengths=new_n)
    feats = eagle3.fuse(dparams, vtaps.layers, dcfg)
    catch_toks = jnp.where(idx <= a[:, None], toks, 0)
    dl, dh, dcache = eagle3.step(
      dparams, dcfg, embed_table, dcache._replace(lengths=n), feats, catch_toks
    )
    dcache = dcache._replace(lengths=new_n)

    st = dict(carry["stats"])
    pos = jnp.arange(G)[None]
    st["policy_passes"] += 1
    st["draft_passes"] += G
    st["rounds"] += 1
    st["tau_sum"] += jnp.sum(jnp.where(active, a + 1, 0))
    st["row_rounds"] += jnp.sum(active)
    st["reach_counts"] += jnp.sum(active[:, None] & (a[:, None] >= pos), 0)
    st["accept_counts"] += jnp.sum(active[:, None] & (a[:, None] > pos), 0)
    return {
      "key": key,
      "pcache": pcache,
      "dcache": dcache,
      "c": jnp.where(active, c_new, c),
      "q_logits": dl[rows, a],
      "h": dh[rows, a],
      "out": out,
      "out_lp": out_lp,
      "out_len": out_len,
      "done": done,
      "stats": st,
    }

  carry = {
    "key": key,
    "pcache": pcache,
    "dcache": dcache,
    "c": c,
    "q_logits": q_logits,
    "h": h,
    "out": out,
    "out_lp": out_lp,
    "out_len": out_len,
    "done": done,
    "stats": stats,
  }
  carry = jax.lax.while_loop(cond, round_, carry)
  lengths = carry["out_len"]
  valid = jnp.arange(N)[None] < lengths[:, None]
  tokens = jnp.where(valid, carry["out"][:, :N], PAD)
  logprobs = jnp.where(valid, carry["out_lp"][:, :N], 0.0)
  return Generation(tokens, logprobs, lengths, carry["stats"])
