"""The save path takes the model's tensors from wherever they live: a LoRA model on CUDA (simulated on this CPU
by ``tests.fake_cuda``, whose tensors refuse to meet CPU tensors as CUDA's do) writes the same adapter, merged
model and export check as the same model on the CPU, bit for bit; adapters never loaded (on the meta device) are a
one-line error naming the tensor. The LoRA-family recipes crashed at their first save on an H200 because the merge
met the model's CUDA adapters with the input's CPU base."""

from __future__ import annotations

import torch
import pytest

from waypoint.checkpointers import CheckpointError, HFCheckpointer, build_model, load_into
from waypoint.models.lora import apply_lora, init_adapters
from waypoint.run.recipe_state import RecipeState
from waypoint.run.savers import WholeStepSaver
from waypoint.run.step_content import ExportReload, adapter_step
from waypoint.training.distributed import Distributed
from tests.conftest import ROOT, tiny_family_config, write_family_checkpoint, write_mxfp4_checkpoint
from tests.fake_cuda import MIXED, fake_cuda, to_fake_cuda
from tests.test_lora import hf_weights


def lora_model(base, targets, dtype=torch.float32):
    """(checkpointer, input state, load report, a LoRA model over ``base`` as lora_finetune.py builds it, its adapters'
    B drawn at random so that the merge changes every adapted weight)."""
    torch.manual_seed(0)  # the adapters' A, drawn as the recipe draws them
    checkpointer = HFCheckpointer(base, output_dir=base.parent / "unused")
    state = checkpointer.load_checkpoint()["model"]
    with torch.device("meta"):
        model = build_model(base)
    apply_lora(model, targets, 4, 8.0)
    report = load_into(model, state, dtype=dtype, fill_later=[k for k in model.state_dict() if ".lora_" in k])
    init_adapters(model, "cpu")
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return checkpointer, state, report, model


def save_step(out, base, checkpointer, state, report, model, lines):
    """The LoRA recipe's final save of ``model`` (adapter, recipe state, merged/ read back) into ``out``/step_1."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    recipe = RecipeState(global_step=1, epoch=0, step_in_epoch=0, steps_per_epoch=1, total_steps=1, epochs=1, seed=0,
                         global_batch=1, config={}, lr_scheduler={}, optimizer=None, rng=None)
    reload = ExportReload(build=lambda: build_model(base),
                          read=lambda path: HFCheckpointer(path, output_dir=out).load_checkpoint()["model"])
    content = adapter_step(model, optimizer, recipe, checkpointer, converter=checkpointer.hf_converter(), base_name="tiny",
                           max_lora_rank=16, layout=None, merge=True, original=state, sources=report.sources,
                           dist=Distributed(), verify=reload, report=lines.append)
    return WholeStepSaver(Distributed(), out, report=lines.append).save(1, content, final=True)


def files_bytes(directory):
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name not in ("MANIFEST.json", "recipe_state.pt")}


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "mxfp4"
    write_mxfp4_checkpoint(path, tiny_family_config("gpt_oss"))
    return path


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe") / "base"
    write_family_checkpoint(path, tiny_family_config("qwen3_moe"))
    return path


CASES = {  # name: (base, targets, dtype)
    "llama fp32": ("tiny", ["q_proj", "v_proj", "w2"], torch.float32),
    "llama bf16, fp32 adapters": ("tiny", ["q_proj", "k_proj", "w1", "w3"], torch.bfloat16),
    "qwen3-moe experts": ("qwen3_moe", ["q_proj", "experts_gate_up", "experts_down"], torch.float32),
    "gpt-oss mxfp4 experts": ("gpt_oss_mxfp4", ["v_proj", "experts_gate_up"], torch.float32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_lora_model_on_cuda_saves_what_it_saves_on_the_cpu(case, tmp_path, request):
    name, targets, dtype = CASES[case]
    base = ROOT / "assets" / "tiny_llama" if name == "tiny" else request.getfixturevalue(name)
    written, lines = {}, {}
    for device in ("cpu", "cuda"):
        out, lines[device] = tmp_path / device, []
        checkpointer, state, report, model = lora_model(base, targets, dtype)
        if device == "cpu":
            step = save_step(out, base, checkpointer, state, report, model, lines[device])
        else:
            with fake_cuda():
                to_fake_cuda(model)
                assert {p.device.type for p in model.parameters()} == {"cuda"}
                step = save_step(out, base, checkpointer, state, report, model, lines[device])
        written[device] = files_bytes(step)
    assert "merged/config.json" in written["cpu"] and "adapter_model.safetensors" in written["cpu"]
    assert written["cuda"].keys() == written["cpu"].keys()
    differing = [name for name in written["cpu"] if written["cuda"][name] != written["cpu"][name]]
    assert not differing, f"written differently from CUDA: {differing}"
    assert any(line.startswith("export verified") for line in lines["cuda"]), lines["cuda"]


def test_the_fake_cuda_device_fails_as_cuda_does():
    """The simulation itself: mixing devices fails (today's merge did), moving to the CPU does not."""
    from tests.fake_cuda import OnCuda

    on_cuda = OnCuda(torch.ones(2, 3))
    assert on_cuda.device.type == "cuda"
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, 3) + on_cuda
    assert torch.equal(on_cuda.to("cpu") + torch.ones(2, 3), torch.full((2, 3), 2.0))
    assert MIXED.startswith("Expected all tensors")


def test_adapters_never_loaded_are_one_line_naming_the_tensor(tmp_path):
    base = ROOT / "assets" / "tiny_llama"
    checkpointer, state, report, model = lora_model(base, ["q_proj", "v_proj"])
    layer = model.layers[0].attn.q_proj
    layer.lora_A.weight = torch.nn.Parameter(torch.empty_like(layer.lora_A.weight, device="meta"))
    with pytest.raises(CheckpointError) as error:
        save_step(tmp_path / "out", base, checkpointer, state, report, model, [])
    message = str(error.value)
    assert "\n" not in message and "layers.0.attn.q_proj.lora_A.weight" in message and "meta device" in message
    assert not (tmp_path / "out" / "step_1").exists()


def test_the_merged_read_back_matches_the_cpu_reference(tmp_path):
    """merged/ from the CUDA model holds W + s * B @ A of the input's weights: its tensors equal the CPU merge's."""
    base = ROOT / "assets" / "tiny_llama"
    checkpointer, state, report, model = lora_model(base, ["q_proj"])
    with fake_cuda():
        to_fake_cuda(model)
        step = save_step(tmp_path / "out", base, checkpointer, state, report, model, [])
    merged = hf_weights(step / "merged")
    source = hf_weights(base)
    changed = [k for k in source if not torch.equal(source[k], merged[k])]
    assert changed and all("q_proj" in k for k in changed)
