"""Each tested family against the plain transformers model on the same ids (fp32):
the model the core builds for ``model=hf model.hf=DIR`` (meta build, ``to_empty``,
``init_weights``, the core's sharded loader) gives the same loss within 1e-5 and the
same gradients; ``init_weights`` rebuilds what ``to_empty`` leaves as garbage."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from titan_hf.config import FLAVORS  # noqa: E402
from titan_hf.model import build  # noqa: E402
from titan_hf.state_dict_adapter import to_hf_name  # noqa: E402
from titan_hf.testing import reference_model, save_folder  # noqa: E402

from titan_plugins.hf import load_hf_model  # noqa: E402

FAMILIES = [n for n in FLAVORS if n != "folder"]  # llama, qwen3, mistral, gemma3, phi3, olmo2, gpt_oss, mixtral, qwen3_moe


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.parametrize("flavor", FAMILIES)
def test_loss_and_grads_equal_transformers(tmp_path, flavor):
    folder = save_folder(flavor, tmp_path / flavor)
    ref = reference_model(folder).train()
    ours = load_hf_model("hf", folder, overrides=["data=synthetic", "data.vocab_size=256"]).train()
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))  # > sliding window 8
    want, got = _loss(ref(ids).logits, ids), _loss(ours(ids), ids)
    assert abs(want.item() - got.item()) <= 1e-5, (want.item(), got.item())
    want.backward()
    got.backward()
    theirs = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        ref_p = theirs[to_hf_name(name)] if to_hf_name(name) in theirs else theirs["model.embed_tokens.weight"]
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref_p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("flavor", ["tiny_gemma3", "tiny_gpt_oss"])
def test_init_weights_rebuilds_buffers(flavor):
    """Rotary ``inv_freq`` (one per layer type for Gemma 3) and Gemma's ``embed_scale``
    are non-persistent: garbage after ``to_empty``, rebuilt by ``init_weights``."""
    from titan_hf.model import hf_config_object
    from transformers import AutoModelForCausalLM

    config = FLAVORS[flavor]
    with torch.device("meta"):
        model = build(config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    for b in model.buffers():
        b.fill_(float("nan"))
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    fresh = AutoModelForCausalLM.from_config(hf_config_object(config))
    want = {n.removeprefix("model."): b for n, b in fresh.named_buffers()}
    got = dict(model.named_buffers())
    assert got, "no buffers"
    for name, buf in got.items():
        key = name.replace("tok_embeddings.", "embed_tokens.").replace("rotary_emb.", "rotary_emb.")
        torch.testing.assert_close(buf, want[key], msg=name)
    assert not any(torch.isnan(p).any() for p in model.parameters())
    assert model.state_dict().keys() == {k for k, _ in model.named_parameters(remove_duplicate=False)}


def test_tied_embeddings_stay_tied_after_init():
    with torch.device("meta"):
        model = build(FLAVORS["tiny_gemma3"])
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    assert model.output.weight is model.tok_embeddings.weight


@pytest.mark.parametrize("flavor", ["tiny_gemma3", "tiny_gpt_oss"])
def test_greedy_generation_with_cache_equals_transformers(tmp_path, flavor):
    """``titan-generate``'s decode loop with the KV cache (transformers' own cache, its
    sliding layers included: 20 positions > window 8) gives transformers' greedy ids."""
    from titan_plugins.generate.sampling import SamplingConfig, generate

    folder = save_folder(flavor, tmp_path / flavor)
    ref = reference_model(folder)
    ours = load_hf_model("hf", folder, overrides=["data=synthetic", "data.vocab_size=256"])
    prompt = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(2))
    got = generate(ours, prompt, SamplingConfig(max_new_tokens=14))
    uncached = generate(ours, prompt, SamplingConfig(max_new_tokens=14, use_cache=False))
    want = ref.generate(prompt, max_new_tokens=14, do_sample=False, min_new_tokens=14, eos_token_id=None)
    assert torch.equal(got, uncached)
    assert torch.equal(got, want[:, prompt.shape[1]:])


@pytest.mark.parametrize("flavor", ["tiny_mixtral", "tiny_qwen3_moe"])
def test_split_experts_export_loads_strictly(tmp_path, flavor):
    """transformers 5 fuses these experts in memory, not on disk: the adapter writes one
    tensor per expert again, and transformers loads the export strictly with our logits."""
    from transformers import AutoModelForCausalLM

    from titan_plugins.hf import export_model

    folder = save_folder(flavor, tmp_path / flavor)
    ours = load_hf_model("hf", folder, overrides=["data=synthetic", "data.vocab_size=256"])
    with torch.no_grad():  # a change the export must carry
        for name, p in ours.named_parameters():
            if ".experts." in name:
                p.add_(0.01)
    export_model(ours, "hf", tmp_path / "out")
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True,
                                                       attn_implementation="sdpa")
    assert not any(info.values()), info
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model.eval()(ids).logits - ours(ids)).abs().max() <= 1e-5
