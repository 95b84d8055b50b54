"""Hugging Face checkpoints in (specdraft/interop/hf.py), against the reference implementation:
tiny randomly initialised `transformers` Llama models (CPU torch, nothing downloaded) saved as
safetensors, imported, and compared on logits (unpacked and packed rows, float32, <= 1e-4) and
greedy generations through the KV cache, token for token."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the `test` extra installs CPU torch and transformers (make test)
import transformers

from specdraft.decode import autoregressive
from specdraft.interop import hf
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import PAD

V = 99


FAMILIES = {
  "llama": ("LlamaConfig", "LlamaForCausalLM"),
  "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),  # q/k/v biases
  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),  # q/k RMSNorm per head
}


def _save_llama(path, *, tie=False, shard=False, family="llama", **kw):
  torch.manual_seed(0)
  config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
  if family == "qwen3":
    kw["head_dim"] = 16  # Qwen3 configs name it (default 128)
  cfg = config_cls(
    vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=tie, max_position_embeddings=128, initializer_range=0.1, **kw,
  )  # fmt: skip
  model = model_cls(cfg).eval()
  with torch.no_grad():  # norms away from 1 and biases away from 0, so a mix-up cannot pass
    for n, p in model.named_parameters():
      if "norm" in n or n.endswith(".bias"):
        p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(str(path), max_shard_size="60KB" if shard else "1GB")
  return model


# RoPE scalings as checkpoints state them, with the pretraining length (32) well inside the test
# rows' reach so that every rule changes some frequencies: linear (Llama 2 long), llama3
# (Llama 3.1+; head dims 0 kept, 1 blended, 2+ divided) and YaRN (Qwen2.5 / Qwen3 long context,
# with its attention factor)
SCALINGS = {
  "linear": {"rope_type": "linear", "factor": 2.0},
  "llama3": {
    "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
  },
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
}  # fmt: skip


@pytest.fixture(
  scope="module",
  params=[
    "llama-untied-sharded", "llama-tied", "qwen2", "qwen3", "llama-linear", "llama-llama3",
    "qwen3-yarn",
  ],
)  # fmt: skip
def llama(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  family, _, variant = request.param.partition("-")
  kw = {"rope_scaling": SCALINGS[variant]} if variant in SCALINGS else {}
  model = _save_llama(path, tie=variant == "tied", shard="sharded" in variant, family=family, **kw)
  pcfg, params = hf.load_policy(str(path))
  return path, model, pcfg, params


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.float().numpy()


def test_config_and_checkpoint_files(llama):
  path, model, pcfg, _ = llama
  files = os.listdir(path)
  if "sharded" in str(path):
    assert (
      "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    )
  assert (pcfg.d_model, pcfg.n_layers, pcfg.n_heads, pcfg.n_kv_heads, pcfg.head_dim, pcfg.d_ff) == (
    64, 3, 4, 2, 16, 96,
  )  # fmt: skip
  assert pcfg.rope_theta == 5000.0 and pcfg.norm_eps == 1e-5
  assert pcfg.tie_embeddings == model.config.tie_word_embeddings
  family = model.config.model_type
  assert (pcfg.qkv_bias, pcfg.qk_norm) == (family == "qwen2", family == "qwen3")
  kind = (model.config.rope_parameters or {}).get("rope_type", "default")
  assert (pcfg.rope_scaling.kind if pcfg.rope_scaling else "default") == kind


def test_rope_scaling_frequencies_equal_transformers():
  """Each scaling's inverse frequencies and attention factor against transformers' own
  (ROPE_INIT_FUNCTIONS), at a pretraining length that puts dimensions in every regime."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  for name, spec in SCALINGS.items():
    for extra in ({}, {"beta_fast": 16.0, "attention_factor": 1.3}) if name == "yarn" else ({},):
      spec = {**spec, **extra}
      cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, rope_theta=5000.0, max_position_embeddings=128,
        rope_scaling=spec,
      )  # fmt: skip
      want_inv, want_att = ROPE_INIT_FUNCTIONS[spec["rope_type"]](cfg, "cpu")
      sc = hf.rope_scaling_of(json.loads(cfg.to_json_string()), None)
      got = pol.rope_inv_freq(16, 5000.0, sc)
      np.testing.assert_allclose(got, want_inv.double().numpy(), rtol=1e-6, err_msg=name)
      assert sc.attention_factor == pytest.approx(want_att, rel=1e-9), name
      assert hf.rope_scaling_of({"rope_scaling": hf.rope_scaling_json(sc)}, None) == sc


def test_logits_equal_transformers_on_unpacked_rows(llama):
  _, model, pcfg, params = llama
  tokens = np.random.default_rng(0).integers(0, V, (2, 20))
  ours, _ = jax.jit(lambda p, t: pol.forward(p, pcfg, t))(params, jnp.asarray(tokens, jnp.int32))
  want = _hf_logits(model, tokens)
  np.testing.assert_allclose(np.asarray(ours), want, rtol=1e-4, atol=1e-4)


def test_logits_equal_transformers_on_packed_rows(llama):
  """Two documents packed in one row (positions restart, segment ids differ) give each
  document's own logits."""
  _, model, pcfg, params = llama
  rng = np.random.default_rng(1)
  a, b = rng.integers(0, V, 11), rng.integers(0, V, 7)
  tokens = np.concatenate([a, b])[None]
  pos = np.concatenate([np.arange(11), np.arange(7)])[None]
  seg = np.concatenate([np.ones(11), 2 * np.ones(7)])[None]
  ours, _ = pol.forward(params, pcfg, *(jnp.asarray(x, jnp.int32) for x in (tokens, pos, seg)))
  ours = np.asarray(ours)[0]
  np.testing.assert_allclose(ours[:11], _hf_logits(model, a[None])[0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ours[11:], _hf_logits(model, b[None])[0], rtol=1e-4, atol=1e-4)


def test_greedy_generation_through_the_kv_cache_equals_transformers(llama):
  """Every one of N greedy tokens through our KV cache equals transformers' `generate`, with the
  stop token disabled on both sides (no row ends early, so the whole length is compared)."""
  _, model, pcfg, params = llama
  rng = np.random.default_rng(2)
  prompt = rng.integers(3, V, (1, 6))
  N = 24
  no_stop = dataclasses.replace(pcfg, eos_id=-1, stop_ids=())
  gen = autoregressive.generate(
    params, no_stop, jnp.asarray(prompt, jnp.int32), jnp.array([6], jnp.int32), jax.random.key(0),
    max_new_tokens=N, temperature=0.0,
  )  # fmt: skip
  ours = np.asarray(gen.tokens)[0]
  model.generation_config.eos_token_id = None
  with torch.no_grad():
    out = model.generate(
      torch.tensor(prompt), max_new_tokens=N, do_sample=False, eos_token_id=None,
      pad_token_id=PAD,
    )[0, 6:].numpy()  # fmt: skip
  assert len(out) == N and int(gen.lengths[0]) == N
  np.testing.assert_array_equal(ours, out)
  assert len(set(out.tolist())) > 2  # not one token repeated


def test_sharded_load_places_each_shard_and_equals_the_host_load(llama):
  path, _, pcfg, params = llama
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  P = jax.sharding.PartitionSpec
  spec = lambda x: (
    P("a")
    if x.ndim >= 2 and x.shape[0] % 2 == 0
    else P(None, "b")
    if x.ndim >= 2 and x.shape[1] % 4 == 0
    else P()
  )
  shardings = jax.tree.map(lambda x: jax.sharding.NamedSharding(mesh, spec(x)), params)
  _, placed = hf.load_policy(str(path), shardings=shardings, dtype=jnp.bfloat16)
  for got, want, sh in zip(
    jax.tree.leaves(placed), jax.tree.leaves(params), jax.tree.leaves(shardings)
  ):
    assert got.sharding == sh and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(jnp.bfloat16))


def test_bad_checkpoints_fail_naming_what_is_wrong(tmp_path):
  path = tmp_path / "m"
  _save_llama(path)
  cfg = json.loads((path / "config.json").read_text())
  pcfg = hf.read_config(str(path))
  # a mis-shaped tensor: read the config of a wider model against these weights
  wide = pol.PolicyConfig(**{**pcfg.__dict__, "d_ff": 128})
  with pytest.raises(
    ValueError,
    match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(96, 64\), expected \(128, 64\)",
  ):
    hf.load_params(str(path), wide)
  deep = pol.PolicyConfig(**{**pcfg.__dict__, "n_layers": 4})
  with pytest.raises(
    KeyError, match=r"'model.layers.3.input_layernorm.weight' is missing \(expected shape \(64,\)\)"
  ):
    hf.load_params(str(path), deep)
  for arch, what in (
    ("MistralForCausalLM", "sliding-window attention"),
    ("GPT2LMHeadModel", "not supported"),
  ):
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=[arch])))
    with pytest.raises(ValueError, match=what):
      hf.read_config(str(path))
  for field, value in (
    ("rope_scaling", {"rope_type": "dynamic", "factor": 8.0}),
    ("rope_scaling", {"rope_type": "longrope", "factor": 8.0}),
    ("rope_parameters", {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 0.5}),
    ("partial_rotary_factor", 0.5),
    ("use_sliding_window", True),
    ("attention_bias", True),
  ):
    (path / "config.json").write_text(json.dumps(dict(cfg, **{field: value})))
    with pytest.raises(ValueError, match=f"config.json {field}="):
      hf.read_config(str(path))


@pytest.mark.parametrize(
  "tie,extra",
  [
    (False, {}), (True, {}), (False, {"qkv_bias": True}), (True, {"qk_norm": True}),
    (False, {"rope_scaling": pol.RopeScaling("llama3", 4.0, original_max_position_embeddings=8)}),
    (True, {"qk_norm": True, "rope_scaling": pol.RopeScaling(
      "yarn", 4.0, original_max_position_embeddings=8, attention_factor=1.2)}),
  ],
  ids=["llama-untied", "llama-tied", "qwen2", "qwen3", "llama-llama3", "qwen3-yarn"],
)  # fmt: skip
def test_exported_policy_loads_in_transformers_with_the_same_logits(tmp_path, tie, extra):
  """The reverse direction: a policy of ours written by save_policy is read by transformers'
  from_pretrained (the reference implementation of its family) and computes our logits; and
  load_policy reads it back unchanged."""
  pcfg = pol.PolicyConfig(
    vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
    rope_theta=500.0, norm_eps=1e-5, tie_embeddings=tie, init_std=0.1, **extra,
  )  # fmt: skip
  params = pol.init_params(pcfg, 3)
  params["final_norm"] = params["final_norm"] + 0.2  # away from the init's ones
  rng = np.random.default_rng(5)
  for k in ("bq", "bk", "bv", "q_norm", "k_norm"):  # away from zeros / ones
    if k in params["layers"]:
      params["layers"][k] = params["layers"][k] + 0.3 * rng.normal(size=params["layers"][k].shape)
  hf.save_policy(str(tmp_path), pcfg, params)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
  assert model.config.tie_word_embeddings == tie
  family = "qwen2" if extra.get("qkv_bias") else "qwen3" if extra.get("qk_norm") else "llama"
  assert model.config.model_type == family
  tokens = np.random.default_rng(4).integers(0, V, (2, 16))
  ours, _ = pol.forward(params, pcfg, jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(np.asarray(ours), _hf_logits(model, tokens), rtol=1e-4, atol=1e-4)
  back_cfg, back = hf.load_policy(str(tmp_path))
  assert back_cfg == pcfg
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))


# ----------------------------------------------------------------------------- EAGLE-3 export


class _TorchEagle3(torch.nn.Module):
  """An independent torch implementation of the public EAGLE-3 draft definition, written for
  this test from that definition (not from specdraft): residual = fc(taps); q/k/v read
  [input_layernorm(embed(x)); hidden_norm(residual)]; rotate-half RoPE; causal GQA attention;
  residual + o_proj; + MLP(post_attention_layernorm); logits = lm_head(norm(h))."""

  def __init__(self, path, embed):
    super().__init__()
    from safetensors.torch import load_file

    self.w = load_file(os.path.join(path, "model.safetensors"))
    self.c = json.loads(open(os.path.join(path, "config.json")).read())
    self.embed = torch.tensor(np.asarray(embed))

  def norm(self, x, w):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + self.c["rms_norm_eps"]))

  def forward(self, taps, tokens):  # taps [B, T, 3E] (low, mid, high), tokens [B, T]
    w, c = self.w, self.c
    H, K, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    B, T = tokens.shape
    h = taps @ w["fc.weight"].T
    x = torch.cat(
      [
        self.norm(self.embed[tokens], w["midlayer.input_layernorm.weight"]),
        self.norm(h, w["midlayer.hidden_norm.weight"]),
      ],
      -1,
    )
    a = "midlayer.self_attn."
    q = (x @ w[a + "q_proj.weight"].T).view(B, T, H, D).transpose(1, 2)
    k = (x @ w[a + "k_proj.weight"].T).view(B, T, K, D).transpose(1, 2)
    v = (x @ w[a + "v_proj.weight"].T).view(B, T, K, D).transpose(1, 2)
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2).float() / D))
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = lambda t: torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1)
    q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
    s = (q @ k.transpose(-1, -2)) / D**0.5
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
    h = h + o @ w[a + "o_proj.weight"].T
    m = "midlayer.mlp."
    z = self.norm(h, w["midlayer.post_attention_layernorm.weight"])
    g = torch.nn.functional.silu(z @ w[m + "gate_proj.weight"].T) * (z @ w[m + "up_proj.weight"].T)
    h = h + g @ w[m + "down_proj.weight"].T
    return self.norm(h, w["norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_exported_eagle3_draft_matches_the_public_definition(tmp_path, reduced):
  """Every key, shape and dtype against the EAGLE-3 table; config fields; and the exported
  checkpoint run through an independent torch implementation gives the draft's logits (with a
  reduced draft vocabulary, mapped to target ids through d2t)."""
  from safetensors import safe_open

  from specdraft.model import eagle3

  pcfg = pol.PolicyConfig(
    vocab_size=V, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96
  )
  dcfg = eagle3.DraftConfig(
    d_model=64,
    vocab_size=V,
    n_taps=len(pcfg.taps),
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    d_ff=80,
    rope_theta=700.0,
    norm_eps=1e-5,
    init_std=0.1,
    vocab_ids=tuple(range(2, V, 3)) if reduced else None,
  )
  Vd = dcfg.draft_vocab
  params = pol.init_params(pcfg, 0)
  dp = eagle3.init_params(dcfg, 1, params, pcfg)
  rng = np.random.default_rng(0)
  for k in ("embed_norm", "hidden_norm", "mlp_norm", "final_norm"):
    dp[k] = dp[k] + 0.3 * rng.normal(size=dp[k].shape)
  hf.save_eagle3(str(tmp_path), dcfg, dp, pcfg)

  E, H, K, D, F = 64, 4, 2, 16, 80
  sizes = {"E": E, "2E": 2 * E, "3E": 3 * E, "H*D": H * D, "K*D": K * D, "F": F, "V": V, "Vd": Vd}
  with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
    assert set(f.keys()) == set(hf.EAGLE3_TENSORS)
    for key, dims in hf.EAGLE3_TENSORS.items():
      t = f.get_tensor(key)
      assert t.shape == tuple(sizes[x] for x in dims), key
      want = np.int64 if key == "d2t" else np.bool_ if key == "t2d" else np.float32
      assert t.dtype == want, key
  c = json.loads((tmp_path / "config.json").read_text())
  assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["num_hidden_layers"] == 1
  assert (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]) == (E, F, H)
  assert (c["num_key_value_heads"], c["head_dim"], c["draft_vocab_size"], c["vocab_size"]) == (
    K,
    D,
    Vd,
    V,
  )
  assert c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(pcfg.taps)

  B, T = 2, 10
  tokens = rng.integers(0, V, (B, T))
  taps = rng.normal(size=(3, B, T, E)).astype(np.float32)
  feat = eagle3.fuse(dp, jnp.asarray(taps), dcfg)
  cache = eagle3.init_cache(dcfg, B, T)
  ours, _, _ = eagle3.prefill(
    dp,
    dcfg,
    params["embed"],
    cache,
    feat,
    jnp.asarray(tokens, jnp.int32),
    jnp.full((B,), T, jnp.int32),
  )
  ref = _TorchEagle3(str(tmp_path), params["embed"])
  with torch.no_grad():
    draft_logits = ref(
      torch.tensor(np.moveaxis(taps, 0, 2).reshape(B, T, 3 * E)), torch.tensor(tokens)
    ).numpy()
  # the serving convention: draft id i is target id i + d2t[i]; t2d marks the covered ids
  d2t, t2d = ref.w["d2t"].numpy(), ref.w["t2d"].numpy()
  target_ids = np.arange(Vd) + d2t
  assert np.array_equal(np.flatnonzero(t2d), np.sort(target_ids))
  want = np.full((B, T, V), -np.inf, np.float32)
  want[..., target_ids] = draft_logits
  ours = np.asarray(ours)
  assert np.array_equal(np.isinf(ours), np.isinf(want))
  np.testing.assert_allclose(ours[..., t2d], want[..., t2d], rtol=1e-4, atol=1e-4)
  if reduced:
    assert Vd < V and not t2d.all() and d2t.any()


def test_eagle3_export_refuses_a_draft_without_three_taps(tmp_path):
  from specdraft.model import eagle3

  pcfg = pol.PolicyConfig(
    vocab_size=V, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64
  )
  dcfg = eagle3.DraftConfig(
    d_model=32, vocab_size=V, n_taps=len(pcfg.taps), n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64
  )
  assert dcfg.n_taps != 3
  with pytest.raises(ValueError, match="exactly 3 tapped layers"):
    hf.save_eagle3(str(tmp_path), dcfg, eagle3.init_params(dcfg, 0), pcfg)


class _TorchDFlash(torch.nn.Module):
  """An independent torch implementation of the public DFlash draft definition, written for this
  test from that definition (not from specdraft): context = hidden_norm(fc(taps)); the block
  [x_anchor, MASK x (W - 1)] is embedded with the target's embedding; in each Qwen3 layer the
  queries read input_layernorm(block), keys and values [context; input_layernorm(block)] through
  the same projections, q_norm / k_norm per head, rotate-half RoPE (context at its positions,
  the block at anchor + k), no mask; residual, MLP; logits = target head(norm(h))."""

  def __init__(self, path, embed, head_EV):
    super().__init__()
    from safetensors.torch import load_file

    self.w = load_file(os.path.join(path, "model.safetensors"))
    self.c = json.loads(open(os.path.join(path, "config.json")).read())
    self.embed = torch.tensor(np.asarray(embed))
    self.head = torch.tensor(np.asarray(head_EV))

  def norm(self, x, w):
    var = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(var + self.c["rms_norm_eps"]))

  def rope(self, t, pos):  # t [B, heads, T, D]
    D = t.shape[-1]
    inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, D, 2).float() / D))
    ang = pos.float()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    rot = torch.cat([-t[..., D // 2 :], t[..., : D // 2]], -1)
    return t * cos + rot * sin

  def forward(self, taps, tokens, anchor):  # taps [B, T, N*E], tokens [B, T]: one anchor
    w, c = self.w, self.c
    H, K, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    W, mask_id = c["block_size"], c["dflash_config"]["mask_token_id"]
    B = tokens.shape[0]
    ctx = self.norm(taps[:, :anchor] @ w["fc.weight"].T, w["hidden_norm.weight"])
    block = torch.full((B, W), mask_id, dtype=torch.long)
    block[:, 0] = tokens[:, anchor]
    x = self.embed[block]
    pos = torch.arange(anchor + W)
    for i in range(c["num_hidden_layers"]):
      p, a = f"layers.{i}.", f"layers.{i}.self_attn."
      h = self.norm(x, w[p + "input_layernorm.weight"])
      kv_in = torch.cat([ctx, h], 1)
      q = (h @ w[a + "q_proj.weight"].T).view(B, W, H, D)
      k = (kv_in @ w[a + "k_proj.weight"].T).view(B, anchor + W, K, D)
      v = (kv_in @ w[a + "v_proj.weight"].T).view(B, anchor + W, K, D).transpose(1, 2)
      q = self.rope(self.norm(q, w[a + "q_norm.weight"]).transpose(1, 2), pos[anchor:])
      k = self.rope(self.norm(k, w[a + "k_norm.weight"]).transpose(1, 2), pos)
      k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
      o = ((q @ k.transpose(-1, -2)) / D**0.5).softmax(-1) @ v
      x = x + o.transpose(1, 2).reshape(B, W, H * D) @ w[a + "o_proj.weight"].T
      z = self.norm(x, w[p + "post_attention_layernorm.weight"])
      g = torch.nn.functional.silu(z @ w[p + "mlp.gate_proj.weight"].T)
      x = x + (g * (z @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return self.norm(x, w["norm.weight"]) @ self.head


def _dflash_draft(n_layers=2, **kw):
  from specdraft.model import dflash

  pcfg = pol.PolicyConfig(
    vocab_size=V, d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=96,
    tap_layers=(6, 1, 3), tie_embeddings=False,
  )  # fmt: skip
  fields = dict(
    kind="dflash", d_model=64, vocab_size=V, n_taps=3, n_layers=n_layers, n_heads=4,
    n_kv_heads=2, head_dim=16, d_ff=80, block_size=4, mask_token_id=5, qk_norm=True,
    rope_theta=700.0, norm_eps=1e-5, init_std=0.1,
  )  # fmt: skip
  dcfg = dflash.BlockDraftConfig(**(fields | kw))
  params = pol.init_params(pcfg, 0)
  dp = dflash.init_params(dcfg, 1, params, pcfg)
  rng = np.random.default_rng(0)  # norms away from 1, so a mix-up of norms cannot pass
  for k in ("ctx_norm", "final_norm"):
    dp[k] = dp[k] + 0.3 * rng.normal(size=dp[k].shape)
  for k in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
    if k in dp["layers"]:
      dp["layers"][k] = dp["layers"][k] + 0.3 * rng.normal(size=dp["layers"][k].shape)
  return pcfg, dcfg, params, dp


def test_exported_dflash_draft_matches_the_public_definition(tmp_path):
  """Every key, shape and dtype against the DFlash table; config fields (read back by
  `transformers`' AutoConfig); and the exported checkpoint run through an independent torch
  implementation gives the draft's block logits at every anchor (<= 1e-4)."""
  from safetensors import safe_open

  from specdraft.model import dflash

  pcfg, dcfg, params, dp = _dflash_draft()
  hf.save_dflash(str(tmp_path), dcfg, dp, pcfg)
  E, H, K, D, F, N, L = 64, 4, 2, 16, 80, 3, 2
  sizes = {"E": E, "N*E": N * E, "H*D": H * D, "K*D": K * D, "D": D, "F": F}
  table = hf.dflash_tensors(L)
  assert len(table) == 3 + 11 * L and "layers.1.self_attn.k_norm.weight" in table
  with safe_open(str(tmp_path / "model.safetensors"), framework="np") as f:
    assert set(f.keys()) == set(table)
    for key, dims in table.items():
      t = f.get_tensor(key)
      assert t.shape == tuple(sizes[x] for x in dims), key
      assert t.dtype == np.float32, key
  c = json.loads((tmp_path / "config.json").read_text())
  assert c["architectures"] == ["DFlashDraftModel"] and c["model_type"] == "qwen3"
  assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (L, E, F)
  assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (H, K, D)
  assert (c["block_size"], c["num_target_layers"], c["vocab_size"]) == (4, 8, V)
  assert c["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [1, 3, 6]}
  assert c["layer_types"] == ["full_attention"] * L and c["rope_theta"] == 700.0
  tc = transformers.AutoConfig.from_pretrained(str(tmp_path))
  assert type(tc).__name__ == "Qwen3Config" and tc.block_size == 4
  assert tc.dflash_config["target_layer_ids"] == [1, 3, 6] and tc.num_hidden_layers == L

  B, T = 2, 9
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, V, (B, T))
  taps = rng.normal(size=(N, B, T, E)).astype(np.float32)
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  seg = jnp.ones((B, T), jnp.int32)
  h = dflash.block_hidden(
    dp, dcfg, params["embed"], jnp.asarray(taps), jnp.asarray(tokens, jnp.int32), pos,
    attend=dflash.attend_dense(seg),
  )  # fmt: skip
  ours = np.asarray(dflash.slot_logits(dp, dcfg, params["head"], h))  # [B, T, W, V]
  ref = _TorchDFlash(str(tmp_path), params["embed"], params["head"])
  flat = torch.tensor(np.moveaxis(taps, 0, 2).reshape(B, T, N * E))
  with torch.no_grad():
    for anchor in range(T):  # anchor 0: a block with no context before it
      want = ref(flat, torch.tensor(tokens), anchor).numpy()
      np.testing.assert_allclose(ours[:, anchor], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
  "change, field",
  [
    (dict(kind="dspark"), r"draft\.kind='dspark'"),
    (dict(mask_token_id=-1), r"draft\.block\.mask_token_id=-1"),
    (dict(qk_norm=False), r"draft\.block\.qk_norm=False"),
    (dict(anchor_residual="mask"), r"draft\.block\.anchor_residual='mask'"),
  ],
)
def test_dflash_export_refuses_what_the_format_cannot_hold(tmp_path, change, field):
  pcfg, dcfg, params, dp = _dflash_draft(n_layers=1, **change)
  with pytest.raises(ValueError, match=field):
    hf.save_dflash(str(tmp_path), dcfg, dp, pcfg)
  assert not os.path.exists(tmp_path / "model.safetensors")


def test_export_run_writes_the_policy_its_tokenizer_and_a_dflash_draft(tmp_path):
  """`export.export_run` (what export.dir runs at the end of a run): the policy read back equals
  the trained one at the export dtype, the tokenizer file travels with it, the draft is DFlash."""
  from safetensors import safe_open

  from specdraft.interop import export

  pcfg, dcfg, params, dp = _dflash_draft(n_layers=1)
  src = tmp_path / "tok"
  src.mkdir()
  (src / "tokenizer.json").write_text('{"version": "1.0"}')
  (src / "generation_config.json").write_text('{"eos_token_id": 2}')
  out = tmp_path / "out"
  written = export.export_run(
    str(out), pcfg, params, dcfg, dp, dtype="bfloat16", tokenizer_path=str(src / "tokenizer.json")
  )
  assert written["draft_format"] == "dflash"
  assert sorted(written["tokenizer_files"]) == ["generation_config.json", "tokenizer.json"]
  assert (out / "policy" / "tokenizer.json").read_text() == '{"version": "1.0"}'
  _, back = hf.load_policy(str(out / "policy"))
  bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(bf16(a), b), params, back)
  with safe_open(str(out / "draft" / "model.safetensors"), framework="np") as f:
    assert set(f.keys()) == set(hf.dflash_tensors(1))
  c = json.loads((out / "draft" / "config.json").read_text())
  assert c["torch_dtype"] == "bfloat16" and c["architectures"] == ["DFlashDraftModel"]
