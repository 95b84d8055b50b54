"""Batched speculative decoding: lossless, static shapes, per-row lengths.

Each round: the draft proposes G tokens after the pending token c; the policy verifies
[c, d_1..d_G] in one pass; rejection sampling accepts a prefix of a tokens and emits a correction
or bonus token c' (tau = a + 1 tokens per round). Both caches roll back by setting their lengths.

- EAGLE-3: G - 1 single-entry draft steps chain the draft's own features; after verification the
  draft catches up on the verified positions with the policy's real features in one (G+1)-wide
  pass whose entry a is already the next round's first proposal.
- DFlash / DSpark (block drafts): one draft pass over the block [c, MASK x (W-1)] proposes G
  tokens at once (DSpark's Markov head then walks the block serially on the sampled tokens);
  after verification the policy's taps at the verified positions become the draft's context.

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), N max new tokens, G draft
tokens per round (G1 = G + 1 verified entries), X = N + G + 1 output buffer, V vocabulary,
E width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdraft.decode.rejection import rejection_sample
from specdraft.decode.sampling import Generation, Sampling, distribution, draw, take
from specdraft.model import dflash, drafts, eagle3
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import PAD


@functools.partial(
  jax.jit,
  static_argnames=(
    "pcfg",
    "dcfg",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "num_draft",
    "sampler",
  ),
)
def generate(
  params,
  dparams,
  pcfg: pol.PolicyConfig,
  dcfg: drafts.DraftConfig,
  prompt_BS,
  prompt_lengths_B,
  key,
  *,
  max_new_tokens: int,
  temperature: float,
  num_draft: int,
  top_k: int = 0,
  top_p: float = 1.0,
  sampler=rejection_sample,
) -> Generation:
  """Speculative generation; same interface and output as `autoregressive.generate`.

  The target the policy's tokens follow is the AR sampler's (`sampling.processed_logits`:
  temperature, top-k, top-p): verification compares it with the draft's distribution under the
  same processing, so the output is distributed exactly as AR sampling with these settings.

  `sampler` is the verification rule (tests swap in a broken one as a negative control).

  stats: policy_passes, draft_passes, rounds, tau_sum and row_rounds (tau = tau_sum/row_rounds),
  accept_counts[G] and reach_counts[G] (per-position conditional acceptance = accept/reach).
  """
  models = _Models(params, dparams, pcfg, dcfg)
  N, G = max_new_tokens, num_draft
  sm = Sampling(temperature, top_k, top_p)
  if drafts.is_block(dcfg):
    if G > dcfg.num_proposals:
      raise ValueError(
        f"num_draft={G}: a {dcfg.kind} draft with block_size {dcfg.block_size} proposes at most "
        f"{dcfg.num_proposals} tokens a round"
      )
    carry = _block_prefill(models, prompt_BS, prompt_lengths_B, key, N=N, G=G, sm=sm)
    one_round = functools.partial(_block_round, models, N=N, G=G, sm=sm, sampler=sampler)
  else:
    carry = _prefill(models, prompt_BS, prompt_lengths_B, key, N=N, G=G, sm=sm)
    one_round = functools.partial(_round, models, N=N, G=G, sm=sm, sampler=sampler)
  carry = jax.lax.while_loop(lambda c: ~jnp.all(c["done"]), one_round, carry)
  lengths_B = carry["out_len"]
  valid_BN = jnp.arange(N)[None] < lengths_B[:, None]
  tokens_BN = jnp.where(valid_BN, carry["out"][:, :N], PAD)
  logprobs_BN = jnp.where(valid_BN, carry["out_lp"][:, :N], 0.0)
  return Generation(tokens_BN, logprobs_BN, lengths_B, carry["stats"])


class _Models:
  """The policy and the draft with their (static) configs, as every piece below needs them."""

  def __init__(self, params, dparams, pcfg, dcfg):
    self.params, self.dparams, self.pcfg, self.dcfg = params, dparams, pcfg, dcfg

  def draft_step(self, dcache, feats_BTE, tokens_BT):
    return eagle3.step(self.dparams, self.dcfg, self.params["embed"], dcache, feats_BTE, tokens_BT)

  def draft_prefill(self, dcache, feats_BTE, tokens_BT, lengths_B):
    return eagle3.prefill(
      self.dparams, self.dcfg, self.params["embed"], dcache, feats_BTE, tokens_BT, lengths_B
    )

  def head_weight(self):
    return pol.head_weight(self.params, self.pcfg)

  def fuse(self, tapped_layers):
    """The draft's input features from the policy's tapped layer outputs (Taps.layers)."""
    return eagle3.fuse(self.dparams, tapped_layers, self.dcfg)


def _policy_prefill(models: _Models, prompt_BS, prompt_lengths_B, key, *, N, G, sm: Sampling):
  """The policy over the prompt and its first token c: (the prompt's taps, the cache capacity,
  the loop carry's policy-side entries). Both drafting paths start here."""
  B, S = prompt_BS.shape
  capacity = S + N + G + 2
  pcache = pol.init_cache(models.pcfg, B, capacity)
  logits_BSV, taps, pcache = pol.prefill(
    models.params, models.pcfg, pcache, prompt_BS, prompt_lengths_B
  )
  key, sub = jax.random.split(key)
  _, logp_BV = distribution(logits_BSV[jnp.arange(B), prompt_lengths_B - 1], *sm)
  c_B = draw(sub, logp_BV, sm.temperature)
  out_len_B = jnp.ones((B,), jnp.int32)
  carry = {
    "key": key,
    "pcache": pcache,
    "c": c_B,
    "out": jnp.full((B, N + G + 1), PAD, jnp.int32).at[:, 0].set(c_B),
    "out_lp": jnp.zeros((B, N + G + 1), jnp.float32).at[:, 0].set(take(logp_BV, c_B)),
    "out_len": out_len_B,
    "done": pol.is_stop(models.pcfg, c_B) | (out_len_B >= N),
  }
  return taps, capacity, carry


def _prefill(models: _Models, prompt_BS, prompt_lengths_B, key, *, N, G, sm: Sampling) -> dict:
  """Policy over the prompt and its first token; the draft over the prompt, shifted by one
  (entry t pairs the feature of token t with token t+1); the loop's initial carry."""
  taps, capacity, carry = _policy_prefill(models, prompt_BS, prompt_lengths_B, key, N=N, G=G, sm=sm)
  B, S = prompt_BS.shape
  rows = jnp.arange(B)
  last = prompt_lengths_B - 1
  shifted_BS = jnp.concatenate([prompt_BS[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
  d_tokens_BS = jnp.where(jnp.arange(S)[None] == last[:, None], carry["c"][:, None], shifted_BS)
  dcache = eagle3.init_cache(models.dcfg, B, capacity)
  d_logits_BSV, d_hidden_BSE, dcache = models.draft_prefill(
    dcache, models.fuse(taps.layers), d_tokens_BS, prompt_lengths_B
  )
  return {
    **carry,
    "dcache": dcache,
    "q_logits": d_logits_BSV[rows, last],
    "h": d_hidden_BSE[rows, last],
    "stats": _initial_stats(G, draft_passes=1),
  }


def _initial_stats(G: int, *, draft_passes: int) -> dict:
  return {
    "policy_passes": jnp.int32(1),
    "draft_passes": jnp.int32(draft_passes),
    "rounds": jnp.int32(0),
    "tau_sum": jnp.int32(0),
    "row_rounds": jnp.int32(0),
    "accept_counts": jnp.zeros((G,), jnp.int32),
    "reach_counts": jnp.zeros((G,), jnp.int32),
  }


def _draft_tokens(models: _Models, key, q_logits_BV, h_BE, dcache, *, G, sm: Sampling):
  """G proposals: the first from the carried logits, then G-1 single-entry draft steps (the
  draft samples under the same processing as the target; any draft distribution is exact, a
  close one is accepted more often)."""
  tokens, probs = [], []
  keys = jax.random.split(key, G)
  for i in range(G):  # G is small and static; unrolled so the last step skips a draft pass
    q_BV, logq_BV = distribution(q_logits_BV, *sm)
    token_B = draw(keys[i], logq_BV, sm.temperature)
    tokens.append(token_B)
    probs.append(q_BV)
    if i < G - 1:
      logits_B1V, h_B1E, dcache = models.draft_step(dcache, h_BE[:, None], token_B[:, None])
      q_logits_BV, h_BE = logits_B1V[:, 0], h_B1E[:, 0]
  return jnp.stack(tokens, 1), jnp.stack(probs, 1), dcache


def _emit(carry, tokens_BG1, logprobs_BG1, a_B, active_B, *, N, G, pcfg):
  """Writes tokens[0..a] after each row's output, cut at a stop token (`pol.is_stop`) and at N;
  finished rows emit nothing. Returns (out, out_lp, out_len, done)."""
  rows = jnp.arange(tokens_BG1.shape[0])
  idx = jnp.arange(G + 1)[None]
  out_len_B = carry["out_len"]
  is_eos = pol.is_stop(pcfg, tokens_BG1) & (idx <= a_B[:, None])
  first_eos_B = jnp.where(is_eos.any(1), jnp.argmax(is_eos, 1), G + 1)
  count_B = jnp.minimum(jnp.minimum(a_B + 1, first_eos_B + 1), N - out_len_B)
  count_B = jnp.where(active_B, count_B, 0)
  write = lambda buf, vals: jax.vmap(lambda b, v, s: jax.lax.dynamic_update_slice(b, v, (s,)))(
    buf, vals, out_len_B
  )
  keep = idx < count_B[:, None]
  current = carry["out"][rows[:, None], out_len_B[:, None] + idx]
  out = write(carry["out"], jnp.where(keep, tokens_BG1, current))
  out_lp = write(carry["out_lp"], jnp.where(keep, logprobs_BG1, 0.0))
  out_len_B = out_len_B + count_B
  done_B = carry["done"] | (first_eos_B <= a_B) | (out_len_B >= N)
  return out, out_lp, out_len_B, done_B


def _count(stats: dict, active_B, a_B, *, G, draft_passes: int) -> dict:
  """Adds one round, which cost `draft_passes` draft passes (EAGLE-3: G; a block draft: 1), to
  the decoding statistics (only rows still generating count)."""
  st = dict(stats)
  pos = jnp.arange(G)[None]
  st["policy_passes"] += 1
  st["draft_passes"] += draft_passes
  st["rounds"] += 1
  st["tau_sum"] += jnp.sum(jnp.where(active_B, a_B + 1, 0))
  st["row_rounds"] += jnp.sum(active_B)
  st["reach_counts"] += jnp.sum(active_B[:, None] & (a_B[:, None] >= pos), 0)
  st["accept_counts"] += jnp.sum(active_B[:, None] & (a_B[:, None] > pos), 0)
  return st


def _verify(models: _Models, carry, key, draft_BG, q_probs_BGV, *, N, G, sm: Sampling, sampler):
  """Verify [c, d_1..d_G] in one policy pass, rejection-sample against the probabilities the
  draft sampled from, emit. Returns (tokens_BG1, accepted a_B, the verification pass's taps, the
  policy cache (lengths not yet rolled back), (out, out_lp, out_len, done))."""
  verify_BG1 = jnp.concatenate([carry["c"][:, None], draft_BG], 1)
  logits_BG1V, vtaps, pcache = pol.decode(models.params, models.pcfg, carry["pcache"], verify_BG1)
  p_probs_BG1V, logp_BG1V = distribution(logits_BG1V, *sm)
  q_probs_BGV = None if sm.temperature == 0 else q_probs_BGV
  tokens_BG1, a_B = sampler(key, draft_BG, q_probs_BGV, p_probs_BG1V)
  logprobs_BG1 = take(logp_BG1V, tokens_BG1)
  emitted = _emit(carry, tokens_BG1, logprobs_BG1, a_B, ~carry["done"], N=N, G=G, pcfg=models.pcfg)
  return tokens_BG1, a_B, vtaps, pcache, emitted


def _round(models: _Models, carry, *, N, G, sm: Sampling, sampler):
  """Draft G tokens, verify them in one policy pass, emit, roll back, let the draft catch up."""
  key, k_draft, k_rej = jax.random.split(carry["key"], 3)
  pcache, c_B = carry["pcache"], carry["c"]
  n_B = pcache.lengths
  active_B = ~carry["done"]
  rows = jnp.arange(c_B.shape[0])
  draft_BG, q_probs_BGV, dcache = _draft_tokens(
    models, k_draft, carry["q_logits"], carry["h"], carry["dcache"], G=G, sm=sm
  )

  tokens_BG1, a_B, vtaps, pcache, emitted = _verify(
    models, carry, k_rej, draft_BG, q_probs_BGV, N=N, G=G, sm=sm, sampler=sampler
  )
  out, out_lp, out_len_B, done_B = emitted

  # Roll back both caches to the verified prefix [.., c, d_1..d_a]; the draft catches up.
  new_n_B = jnp.where(active_B, n_B + a_B + 1, n_B)
  catch_up_BG1 = jnp.where(jnp.arange(G + 1)[None] <= a_B[:, None], tokens_BG1, 0)
  d_logits_BG1V, d_hidden_BG1E, dcache = models.draft_step(
    dcache._replace(lengths=n_B), models.fuse(vtaps.layers), catch_up_BG1
  )
  return {
    "key": key,
    "pcache": pcache._replace(lengths=new_n_B),
    "dcache": dcache._replace(lengths=new_n_B),
    "c": jnp.where(active_B, tokens_BG1[rows, a_B], c_B),
    "q_logits": d_logits_BG1V[rows, a_B],
    "h": d_hidden_BG1E[rows, a_B],
    "out": out,
    "out_lp": out_lp,
    "out_len": out_len_B,
    "done": done_B,
    "stats": _count(carry["stats"], active_B, a_B, G=G, draft_passes=G),
  }


# ----------------------------------------------------------------------------- block drafts


def _block_prefill(models: _Models, prompt_BS, prompt_lengths_B, key, *, N, G, sm: Sampling):
  """Policy over the prompt and its first token c; the prompt's taps become the draft's context
  (positions 0 .. P-1, c's block anchored at P). The loop's initial carry."""
  taps, capacity, carry = _policy_prefill(models, prompt_BS, prompt_lengths_B, key, N=N, G=G, sm=sm)
  B = prompt_BS.shape[0]
  dcache = dflash.init_cache(models.dcfg, B, capacity)
  dcache = dflash.write_context(
    models.dparams, models.dcfg, dcache, taps.layers, jnp.zeros((B,), jnp.int32), prompt_lengths_B
  )
  return {**carry, "dcache": dcache, "stats": _initial_stats(G, draft_passes=0)}


def _block_tokens(models: _Models, key, h_BWE, c_B, *, G, sm: Sampling):
  """G proposals from one block pass: DFlash samples every slot from its own distribution
  (they do not depend on each other); DSpark walks the block left to right, each slot's logits
  shifted by the Markov term of the token sampled before it (c for the first). Returns the
  tokens [B, G] and the probabilities they were sampled from [B, G, V]. (DSpark without its
  Markov head, markov_rank = 0, samples its slots in parallel like DFlash.)"""
  dp, dcfg = models.dparams, models.dcfg
  w = models.head_weight()
  first = dcfg.first_slot
  keys = jax.random.split(key, G)
  if not dcfg.has_markov:
    logits_BGV = dflash.slot_logits(dp, dcfg, w, h_BWE[:, first : first + G])
    q_BGV, logq_BGV = distribution(logits_BGV, *sm)
    tokens = [draw(keys[g], logq_BGV[:, g], sm.temperature) for g in range(G)]
    return jnp.stack(tokens, 1), q_BGV
  tokens, probs, prev = [], [], c_B
  for g in range(G):  # G is small and static
    q_BV, logq_BV = distribution(dflash.slot_logits(dp, dcfg, w, h_BWE[:, first + g], prev), *sm)
    prev = draw(keys[g], logq_BV, sm.temperature)
    tokens.append(prev)
    probs.append(q_BV)
  return jnp.stack(tokens, 1), jnp.stack(probs, 1)


def _block_round(models: _Models, carry, *, N, G, sm: Sampling, sampler):
  """Propose a block, verify it in one policy pass, emit, roll back; the policy's taps at the
  verified positions become the draft's context."""
  key, k_draft, k_rej = jax.random.split(carry["key"], 3)
  pcache, c_B = carry["pcache"], carry["c"]
  n_B = pcache.lengths
  active_B = ~carry["done"]
  rows = jnp.arange(c_B.shape[0])
  h_BWE = dflash.propose_hidden(
    models.dparams, models.dcfg, models.params["embed"], carry["dcache"], c_B
  )
  draft_BG, q_probs_BGV = _block_tokens(models, k_draft, h_BWE, c_B, G=G, sm=sm)

  tokens_BG1, a_B, vtaps, pcache, emitted = _verify(
    models, carry, k_rej, draft_BG, q_probs_BGV, N=N, G=G, sm=sm, sampler=sampler
  )
  out, out_lp, out_len_B, done_B = emitted

  # Verified prefix [.., c, d_1..d_a]: the policy's taps there are the next block's context.
  new_n_B = jnp.where(active_B, n_B + a_B + 1, n_B)
  dcache = dflash.write_context(
    models.dparams, models.dcfg, carry["dcache"], vtaps.layers, n_B, new_n_B
  )
  return {
    "key": key,
    "pcache": pcache._replace(lengths=new_n_B),
    "dcache": dcache,
    "c": jnp.where(active_B, tokens_BG1[rows, a_B], c_B),
    "out": out,
    "out_lp": out_lp,
    "out_len": out_len_B,
    "done": done_B,
    "stats": _count(carry["stats"], active_B, a_B, G=G, draft_passes=1),
  }
