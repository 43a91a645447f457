"""Minimal fake modules (transformers, einops, packaging, fla, llmcompressor) so that Moonshot's
modeling_kimi_k3_linear.py can be imported with torch only. The fla kernels are replaced by plain-torch
float64 implementations of fla's own torch-reference semantics."""
import sys, types, logging as _logging, re
import torch
import torch.nn as nn
import torch.nn.functional as F


def _mod(name, **attrs):
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    sys.modules[name] = m
    return m


class _Subscriptable:
    def __class_getitem__(cls, item):
        return cls


# ---------------- packaging ----------------
class _V:
    def __init__(self, s):
        self.t = tuple(int(x) for x in re.findall(r"\d+", s)[:3])
    def __ge__(self, o):
        return self.t >= o.t
_mod("packaging")
_mod("packaging.version", parse=_V)
sys.modules["packaging"].version = sys.modules["packaging.version"]

# ---------------- einops ----------------
def rearrange(x, pattern, **kw):
    p = pattern.replace(" ", "")
    if p == "bs...->(bs)...":
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if p == "...(hd)->...hd":
        d = kw["d"]
        return x.reshape(*x.shape[:-1], x.shape[-1] // d, d)
    if p == "bthd->bt(hd)":
        return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    raise NotImplementedError(pattern)
_mod("einops", rearrange=rearrange)

# ---------------- transformers ----------------
class PreTrainedModel(nn.Module):
    def __init__(self, config, *a, **k):
        super().__init__()
        self.config = config
    def post_init(self):
        pass

class _Out(dict):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.__dict__.update(kw)
    def __getitem__(self, k):
        if isinstance(k, int):
            return list(self.values())[k]
        return dict.__getitem__(self, k)
    def __getattr__(self, n):
        return self.get(n)

def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids, **kw):
    T = inputs_embeds.shape[1]
    dt = inputs_embeds.dtype
    m = torch.full((T, T), torch.finfo(dt).min, dtype=dt)
    m = torch.triu(m, diagonal=1)
    return m[None, None].expand(inputs_embeds.shape[0], 1, T, T)

class _Logger:
    def __init__(self, n):
        self.l = _logging.getLogger(n)
    def warning_once(self, *a, **k):
        self.l.warning(*a)
    def __getattr__(self, n):
        return getattr(self.l, n)

_ident = lambda f: f
tf = _mod("transformers", __version__="4.57.0")
_mod("transformers.activations", ACT2FN={})
_mod("transformers.cache_utils", Cache=object)
_mod("transformers.generation", GenerationMixin=object)
_mod("transformers.masking_utils", create_causal_mask=create_causal_mask)
_mod("transformers.modeling_flash_attention_utils", FlashAttentionKwargs=dict)
_mod("transformers.modeling_outputs", BaseModelOutputWithPast=_Out, CausalLMOutputWithPast=_Out)
_mod("transformers.modeling_utils", ALL_ATTENTION_FUNCTIONS={}, PreTrainedModel=PreTrainedModel)
_mod("transformers.processing_utils", Unpack=_Subscriptable)
_mod("transformers.pytorch_utils", ALL_LAYERNORM_LAYERS=[])
_mod("transformers.utils", TransformersKwargs=dict, can_return_tuple=_ident,
     logging=types.SimpleNamespace(get_logger=_Logger), is_flash_attn_2_available=lambda: False)
_mod("transformers.utils.generic", check_model_inputs=_ident)
_mod("transformers.utils.output_capturing", OutputRecorder=lambda *a, **k: None)

# ---------------- llmcompressor ----------------
_mod("llmcompressor"); _mod("llmcompressor.modeling"); _mod("llmcompressor.modeling.moe")
_mod("llmcompressor.modeling.moe.context", get_calibrate_all_experts_flag=lambda: False)

# ---------------- fla ----------------
class ShortConvolution(nn.Conv1d):
    """fla.modules.ShortConvolution: depthwise causal conv1d (weight [C,1,K], no bias) + activation."""
    def __init__(self, hidden_size, kernel_size, bias=False, activation="silu", **kw):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1, bias=bias)
        self.activation = activation
    def forward(self, x, cache=None, output_final_state=False, cu_seqlens=None, **kw):
        assert cache is None and cu_seqlens is None
        T = x.shape[1]
        y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=self.kernel_size[0] - 1,
                     groups=self.groups)[..., :T].transpose(1, 2)
        if self.activation in ("silu", "swish"):
            y = F.silu(y)
        return y, None


class FusedRMSNormGated(nn.Module):
    """fla.modules.FusedRMSNormGated (torch reference): rmsnorm(x) * weight * act(g)."""
    def __init__(self, hidden_size, eps=1e-5, activation="sigmoid", **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.activation = activation
    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        if self.activation == "sigmoid":
            return y * torch.sigmoid(g)
        return y * F.silu(g)


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _kda_naive(q, k, v, g, beta, A_log=None, dt_bias=None, scale=None, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
               use_beta_sigmoid_in_kernel=False, safe_gate=False, lower_bound=None,
               transpose_state_layout=False, cu_seqlens=None, **kw):
    """Naive recurrence of fla's KDA (naive_recurrent_kda + kda_gate_ref), q,k,v,g [B,T,H,D], beta [B,T,H]."""
    assert cu_seqlens is None
    B, T, H, D = q.shape
    Dv = v.shape[-1]
    if scale is None:
        scale = D ** -0.5
    if use_gate_in_kernel:
        A = A_log.reshape(-1)[:H].exp().view(H, 1)
        gg = g + dt_bias.view(H, D)
        if lower_bound is not None:
            g = lower_bound * torch.sigmoid(A * gg)
        else:
            g = -A * F.softplus(gg)
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid()
    if use_qk_l2norm_in_kernel:
        q = _l2norm(q)
        k = _l2norm(k)
    q = q * scale
    S = q.new_zeros(B, H, D, Dv) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]                       # diag(exp(g_t)) S
        kt, vt, bt = k[:, t], v[:, t], beta[:, t]
        u = torch.einsum("bhk,bhkv->bhv", kt, S)
        S = S + torch.einsum("bhk,bhv->bhkv", kt, bt[..., None] * (vt - u))
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    o = torch.stack(outs, 1)
    return o, (S if output_final_state else None)


def tensor_cache(f):
    return f

_mod("fla")
_mod("fla.modules", FusedRMSNormGated=FusedRMSNormGated, ShortConvolution=ShortConvolution)
_mod("fla.ops"); _mod("fla.ops.kda", chunk_kda=_kda_naive, fused_recurrent_kda=_kda_naive)
_mod("fla.ops.utils"); _mod("fla.ops.utils.index", prepare_cu_seqlens_from_mask=None, prepare_lens_from_mask=None)
_mod("fla.utils", tensor_cache=tensor_cache)


# ---------------- configuration_kimi_k3 ----------------
class KimiLinearConfig:
    def __init__(self, d):
        self.__dict__.update(d)
        self.use_cache = False
        self.output_attentions = False
        self.output_hidden_states = False
        self.use_return_dict = True
        self._attn_implementation = "eager"
    def is_kda_layer(self, i):
        return self.linear_attn_config is not None and (i + 1) in self.linear_attn_config["kda_layers"]
    @property
    def is_mla(self):
        return self.q_lora_rank is not None or self.kv_lora_rank is not None
    def __getattr__(self, n):   # like PretrainedConfig: missing -> AttributeError; getattr(c, x, default) works
        raise AttributeError(n)
_mod("configuration_kimi_k3", KimiLinearConfig=KimiLinearConfig)
