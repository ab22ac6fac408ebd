"""Model families no test names, through scale and fuse at ratios 1 and 4 (issue 32).

Each model is built from a small config with random init (nothing downloaded), in float64:
ratio 1 must be bit-identical to the model (its loss), and three ratio-r surrogates fused must
train like the three trained separately (three steps of AdamW with muP's learning rates; SGD
for the CNN, as tests/fusion/test_real_models.py does), losses, gradients, parameters and
optimizer state to 1e-9 relative (``check`` of that test).

    python benchmarks/recurrent_families.py                   # every family
    python benchmarks/recurrent_families.py t5,mamba
    RESCALE=6 python benchmarks/recurrent_families.py rwkv    # RWKV's default rescale_every

Measured (transformers 5.25, torchvision 0.29):

    t5               ratio 1 and 4: pass (T5's relative-position bucket `where`s run per trial
                     under vmap, logged as fallbacks)
    whisper_encoder  ratio 1 and 4: pass (its frozen sinusoid table rebuilt)
    mamba            ratio 1 and 4: pass (A_log rebuilt; two matmuls under vmap)
    seq2seq_gru      ratio 1 and 4: pass (PyTorch's translation tutorial, GRU + attention)
    shufflenet_v2    ratio 1 and 4: pass (channel shuffle)
    rwkv             ratio 1: pass with rescale_every=0; ratio 4: ScaleError, its time_decay
                     init is structured by no rule Hydro rebuilds; with rescale_every=6 (the
                     default): ScaleError, forward writes its weights in place in eval mode
"""

import sys
import warnings
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hydro
import hydro.optim
from hydro.parametrize import param_groups
from tests.fusion.exactness import clone
from tests.fusion.real import no_dropout
from tests.fusion.test_real_models import LRS, batches, check

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
V = 50


def t5():
    import transformers as T

    cfg = T.T5Config(
        vocab_size=V,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        use_cache=False,
    )

    def make(b, g):
        x = torch.randint(2, V, (b, 10), generator=g)
        y = torch.randint(2, V, (b, 6), generator=g)
        return (), {"input_ids": x, "labels": y}

    return T.T5ForConditionalGeneration(cfg), make


def whisper():
    import transformers as T

    cfg = T.WhisperConfig(
        vocab_size=V,
        num_mel_bins=16,
        encoder_layers=2,
        encoder_attention_heads=4,
        decoder_layers=1,
        decoder_attention_heads=4,
        d_model=32,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=12,
        max_target_positions=16,
        num_labels=3,
        use_cache=False,
    )

    def make(b, g):
        return (), {
            "input_features": torch.randn(b, 16, 24, generator=g),
            "labels": torch.randint(0, 3, (b,), generator=g),
        }

    return T.WhisperForAudioClassification(cfg), make


def _lm_batch(b, g):
    x = torch.randint(1, V, (b, 10), generator=g)
    return (), {"input_ids": x, "labels": x}


def mamba():
    import transformers as T

    common = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, use_cache=False,
                  bos_token_id=0, eos_token_id=0)
    cfg = T.MambaConfig(state_size=16, expand=2, conv_kernel=4, time_step_rank=4,
                        pad_token_id=0, **common)
    return T.MambaForCausalLM(cfg), _lm_batch


def rwkv():
    import os

    import transformers as T

    rescale = int(os.environ.get("RESCALE", "0"))  # RWKV's default is 6
    cfg = T.RwkvConfig(vocab_size=V, context_length=16, hidden_size=32, num_hidden_layers=2,
                       attention_hidden_size=32, intermediate_size=64, use_cache=False,
                       bos_token_id=0, eos_token_id=0, rescale_every=rescale)
    return T.RwkvForCausalLM(cfg), _lm_batch


class EncoderRNN(nn.Module):
    def __init__(self, v, h):
        super().__init__()
        self.embedding = nn.Embedding(v, h)
        self.gru = nn.GRU(h, h, batch_first=True)

    def forward(self, x):
        return self.gru(self.embedding(x))


class BahdanauAttention(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.Wa = nn.Linear(h, h)
        self.Ua = nn.Linear(h, h)
        self.Va = nn.Linear(h, 1)

    def forward(self, query, keys):
        scores = self.Va(torch.tanh(self.Wa(query) + self.Ua(keys))).squeeze(2).unsqueeze(1)
        weights = torch.softmax(scores, dim=-1)
        return torch.bmm(weights, keys), weights


class AttnDecoderRNN(nn.Module):
    def __init__(self, h, v, steps):
        super().__init__()
        self.embedding = nn.Embedding(v, h)
        self.attention = BahdanauAttention(h)
        self.gru = nn.GRU(2 * h, h, batch_first=True)
        self.out = nn.Linear(h, v)
        self.steps = steps

    def forward(self, enc_out, enc_hidden, target):
        b = enc_out.size(0)
        dec_in = torch.zeros(b, 1, dtype=torch.long, device=enc_out.device)
        hidden = enc_hidden
        outs = []
        for i in range(self.steps):
            emb = self.embedding(dec_in)
            query = hidden.permute(1, 0, 2)
            context, _ = self.attention(query, enc_out)
            out, hidden = self.gru(torch.cat((emb, context), dim=2), hidden)
            outs.append(self.out(out))
            dec_in = target[:, i].unsqueeze(1)  # teacher forcing
        return torch.log_softmax(torch.cat(outs, 1), -1)


class Seq2Seq(nn.Module):
    """PyTorch's seq2seq translation tutorial (GRU encoder, Bahdanau-attention GRU decoder)."""

    def __init__(self):
        super().__init__()
        self.encoder = EncoderRNN(V, 64)
        self.decoder = AttnDecoderRNN(64, V, 6)

    def forward(self, src, tgt):
        enc_out, enc_hidden = self.encoder(src)
        logp = self.decoder(enc_out, enc_hidden, tgt)
        return logp, nn.functional.nll_loss(logp.reshape(-1, logp.shape[-1]), tgt.reshape(-1))


def seq2seq():
    def make(b, g):
        return (
            torch.randint(0, V, (b, 8), generator=g),
            torch.randint(0, V, (b, 6), generator=g),
        ), {}

    return Seq2Seq(), make


def shufflenet():
    import torchvision

    m = torchvision.models.shufflenet_v2_x0_5(num_classes=5)
    m.stage3 = m.stage3[:2]

    def make(b, g):
        return (torch.randn(4, 3, 64, 64, generator=g),), {}

    return m, make


FAMILIES = {
    "t5": t5,
    "whisper_encoder": whisper,
    "mamba": mamba,
    "rwkv": rwkv,
    "seq2seq_gru": seq2seq,
    "shufflenet_v2": shufflenet,
}


def run(name, ratio):
    torch.manual_seed(0)
    model, make = FAMILIES[name]()
    model = no_dropout(model).double()
    data = batches(name, make)
    args, kwargs = data[0]
    members = [
        hydro.scale(model, ratio, example_inputs=args, example_kwargs=kwargs, seed=k).train()
        for k in range(3)
    ]
    if ratio == 1:
        one = members[0]
        one.load_state_dict(model.state_dict(), strict=False)
        model.train()
        o1 = one(*args, **kwargs)
        o0 = model(*args, **kwargs)
        a = getattr(o1, "loss", None)
        b = getattr(o0, "loss", None)
        if a is None:
            a, b = (
                (o1[0] if isinstance(o1, tuple) else o1),
                (o0[0] if isinstance(o0, tuple) else o0),
            )
        assert torch.equal(a, b), f"ratio 1 not bit-identical: {(a - b).abs().max()}"
    fused = hydro.fuse([clone(m) for m in members])
    import types

    for m in members:  # frozen tables (Whisper's positions) have no gradient to compare
        orig = m.named_parameters
        m.named_parameters = types.MethodType(
            lambda self, *a, orig=orig, **k: ((n, p) for n, p in orig(*a, **k) if p.requires_grad),
            m,
        )
        m.parameters = types.MethodType(
            lambda self, *a, **k: (p for _, p in self.named_parameters()), m
        )
    if name == "shufflenet_v2":  # BatchNorm-before-BatchNorm biases: SGD, as test_real_models
        from tests.fusion.test_real_models import TIMM_LRS

        opts = [
            torch.optim.SGD(param_groups(m, lr=lr, weight_decay=0.01, kind="sgd"), momentum=0.9)
            for m, lr in zip(members, TIMM_LRS)
        ]
        fopt = hydro.optim.SGD(fused.parameters(), lr=TIMM_LRS, momentum=0.9, weight_decay=0.01)
    else:
        opts = [
            torch.optim.AdamW(param_groups(m, lr=lr, weight_decay=0.01))
            for m, lr in zip(members, LRS)
        ]
        fopt = hydro.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.01)
    check(f"{name} r{ratio}", fused, members, opts, fopt, data)
    return fused.fallbacks


if __name__ == "__main__":
    for name in sys.argv[1].split(",") if len(sys.argv) > 1 else FAMILIES:
        for ratio in (1, 4):
            try:
                fb = run(name, ratio)
                print(f"RESULT {name} ratio {ratio}: PASS (fallbacks {fb})", flush=True)
            except Exception as e:
                msg = str(e).replace("\n", " ")
                print(f"RESULT {name} ratio {ratio}: {type(e).__name__}: {msg[:900]}", flush=True)
