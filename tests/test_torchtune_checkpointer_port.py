"""torchtune 0.6.1's checkpointer tests, their assertions ported onto Waypoint's checkpointers, and the torchtune
config surface the README promises moves over (a checkpointer section as torchtune writes it, ``_component_``).

Ported from torchtune v0.6.1 ``tests/torchtune/training/checkpointing/test_checkpointer.py`` (``TestHFLlama2FullModel
Checkpointer``, ``TestHFGemmaFullModelCheckpointer``) and ``test_checkpointer_utils.py`` (``TestCheckpointerUtils``,
``TestFormattedCheckpointFiles``, ``TestCheckOutdirNotInCkptdir``); the models are tiny transformers models built here.
Not ported: ``TestHFMistralRewardModelFullModelCheckpointer`` and ``TestUpdateStateDictForClassifer`` (Waypoint has
no classifier / reward heads). Where Waypoint differs by design, the comment beside the assertion says so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.conftest import ROOT, tiny_family_config, tiny_llama_config, write_family_checkpoint, write_hf_checkpoint
from waypoint.checkpointers import (CheckpointError, HFCheckpointer, MetaCheckpointer, NativeCheckpointer, build_model,
                                    load_into)
from waypoint.checkpointers.file_formats import read_tensors

ADAPTER_MODEL, ADAPTER_CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
INV_FREQ = "rotary_emb.inv_freq"
# torchtune's LoRA test adapts lm_head, which vLLM does not serve: the save warns so (checkpointers.peft_adapter)
pytestmark = pytest.mark.filterwarnings("ignore:vLLM. target module")


# -- the fixture: torchtune's two-file Llama 2 checkpoint, from a transformers model ----------------------------------
def write_pt_checkpoint(directory: Path, layers: int) -> tuple[Path, ...]:
    """torchtune's ``llama2_hf_checkpoints``: fp16 HF keys in ``llama2_hf_checkpoint_0N.pt`` (layer 0, the embedding,
    norm and lm_head in the first; layer 1 in the second), each layer with its ``rotary_emb.inv_freq``, config.json
    beside them (vocab 100, dim 64, 4 heads, 4 kv heads); here the weights are a transformers LlamaForCausalLM's."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(16)
    config = tiny_llama_config(n_heads=4, n_kv_heads=4, hidden=64, layers=layers, vocab=100)
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True)
    config.to_json_file(directory / "config.json")
    state = {k: v.to(torch.float16) for k, v in model.state_dict().items()}
    files = []
    for i in range(layers):
        part = {k: v for k, v in state.items() if f"layers.{i}." in k or (i == 0 and ".layers." not in k)}
        part[f"model.layers.{i}.self_attn.{INV_FREQ}"] = torch.randn(16, dtype=torch.float16)
        files.append(directory / f"llama2_hf_checkpoint_{i + 1:02d}.pt")
        torch.save(part, files[-1])
    return tuple(files)


@pytest.fixture
def llama2_hf_checkpoints(tmp_path):
    return write_pt_checkpoint(tmp_path / "checkpoint_dir", layers=2)


def checkpointer(files, tmp_path, **kwargs) -> HFCheckpointer:
    # torchtune's fixture passes the files as absolute Paths inside checkpoint_dir
    return HFCheckpointer(checkpoint_dir=files[0].parent, checkpoint_files=list(files), model_type="LLAMA2",
                          output_dir=tmp_path / "output_dir", **kwargs)


def loads_into_the_model(checkpoint_dir: Path, state: dict) -> torch.nn.Module:
    with torch.device("meta"):
        model = build_model(checkpoint_dir)
    load_into(model, state["model"], device="cpu")  # strict: every key, no more (torchtune: model.load_state_dict)
    return model


# -- TestHFLlama2FullModelCheckpointer ----------------------------------------------------------------------------------
def test_load_save_checkpoint_single_file(tmp_path):
    (checkpoint_file,) = write_pt_checkpoint(tmp_path / "checkpoint_dir", layers=1)
    ckpt = checkpointer([checkpoint_file], tmp_path)
    orig_state_dict = torch.load(checkpoint_file, weights_only=True)
    state_dict = ckpt.load_checkpoint()
    assert len(state_dict["model"].keys()) + 1 == len(orig_state_dict.keys())  # inv_freq is not a weight
    for key in orig_state_dict:
        if INV_FREQ in key:
            continue
        # torchtune: key in checkpointer._weight_map (key -> "0001"); ours: the public layout's key -> file name
        assert ckpt.layout.weight_map[key] == checkpoint_file.name
    loads_into_the_model(checkpoint_file.parent, state_dict)

    out = ckpt.save_checkpoint(state_dict, epoch=1)
    # By design: the step directory is step_1 (torchtune: epoch_1), and the file keeps its input's name and format
    # (torchtune renames it model-00001-of-00001.safetensors)
    assert out == tmp_path / "output_dir" / "step_1"
    output_state_dict = read_tensors(out / checkpoint_file.name)
    assert len(output_state_dict.keys()) + 1 == len(orig_state_dict.keys())
    # beyond torchtune's assertions: every tensor comes back bit for bit, in its dtype
    for key, tensor in output_state_dict.items():
        assert tensor.dtype == torch.float16 and torch.equal(tensor, orig_state_dict[key]), key


def test_save_load_checkpoint_multiple_file(llama2_hf_checkpoints, tmp_path):
    checkpoint_file_1, checkpoint_file_2 = llama2_hf_checkpoints
    ckpt = checkpointer(llama2_hf_checkpoints, tmp_path)
    orig_state_dict_1 = torch.load(checkpoint_file_1, weights_only=True)
    orig_state_dict_2 = torch.load(checkpoint_file_2, weights_only=True)
    state_dict = ckpt.load_checkpoint()
    assert len(state_dict["model"].keys()) + 2 == len(orig_state_dict_1.keys()) + len(orig_state_dict_2.keys())
    for orig, file in ((orig_state_dict_1, checkpoint_file_1), (orig_state_dict_2, checkpoint_file_2)):
        for key in orig:
            if INV_FREQ not in key:
                assert ckpt.layout.weight_map[key] == file.name  # torchtune: key in _weight_map
    loads_into_the_model(checkpoint_file_1.parent, state_dict)

    out = ckpt.save_checkpoint(state_dict, epoch=1)
    # By design: step_1/ with the input's two file names (torchtune: epoch_1/model-0000{1,2}-of-00002.safetensors)
    output_state_dict_1 = read_tensors(out / checkpoint_file_1.name)
    output_state_dict_2 = read_tensors(out / checkpoint_file_2.name)
    assert len(output_state_dict_1.keys()) + 1 == len(orig_state_dict_1.keys())
    assert len(output_state_dict_2.keys()) + 1 == len(orig_state_dict_2.keys())


def lora_model(checkpoint_dir: Path, state: dict, targets=("q_proj", "output_proj", "w1", "w2", "w3", "output")):
    """torchtune's ``lora_llama2(lora_attn_modules=[q_proj, output_proj], apply_lora_to_mlp=True,
    apply_lora_to_output=True, lora_rank=4, lora_alpha=8)`` with the base weights loaded and random LoRA B."""
    from waypoint.models.lora import apply_lora, lora_modules

    model = loads_into_the_model(checkpoint_dir, state)
    apply_lora(model, list(targets), rank=4, alpha=8)
    torch.manual_seed(3)
    for module in lora_modules(model).values():  # B starts at zero: random, so its permutation on save shows
        module.lora_B.weight.data = torch.randn_like(module.lora_B.weight)
    return model


def torchtune_adapter(model) -> dict[str, torch.Tensor]:
    """The adapter as a torchtune loop holds it: its module names are ours, its A/B lower-case (lora_a, lora_b)."""
    from waypoint.models.lora import adapter_state

    return {k.replace("lora_A", "lora_a").replace("lora_B", "lora_b"): v for k, v in adapter_state(model).items()}


TORCHTUNE_ADAPTER_CONFIG = {"r": 4, "lora_alpha": 8, "peft_type": "LORA",
                            "target_modules": ["q_proj", "output_proj", "w1", "w2", "w3", "output"]}


def test_load_save_adapter_only(tmp_path):
    (checkpoint_file,) = write_pt_checkpoint(tmp_path / "checkpoint_dir", layers=1)
    ckpt = checkpointer([checkpoint_file], tmp_path)
    state_dict = ckpt.load_checkpoint()
    # torchtune: ValueError "Adapter checkpoint not found in state_dict"; ours: the one-line CheckpointError
    with pytest.raises(CheckpointError, match="adapter_only=True.*no 'adapter' entry"):
        ckpt.save_checkpoint(state_dict, epoch=2, adapter_only=True)
    # By design: torchtune writes an empty adapter_model.safetensors for state_dict["adapter"] = {}; a PEFT adapter
    # with no tensors serves nothing, so it is refused in one line and nothing is written
    with pytest.raises(CheckpointError, match=r"state_dict\['adapter'\] is empty"):
        ckpt.save_checkpoint({**state_dict, "adapter": {}, "adapter_config": TORCHTUNE_ADAPTER_CONFIG}, epoch=2,
                             adapter_only=True)
    assert not (tmp_path / "output_dir" / "step_2").exists()

    model = lora_model(checkpoint_file.parent, state_dict)
    out = ckpt.save_checkpoint({**state_dict, "adapter": torchtune_adapter(model),
                                "adapter_config": TORCHTUNE_ADAPTER_CONFIG}, epoch=2, adapter_only=True)
    # torchtune: loading the model file fails ("Unable to load checkpoint from"): it is not written; ours: the same
    assert not (out / checkpoint_file.name).exists()
    assert (out / ADAPTER_MODEL).is_file() and (out / ADAPTER_CONFIG_FILE).is_file()
    assert len(read_tensors(out / ADAPTER_MODEL)) == 2 * 6  # torchtune checks its empty adapter's 0 keys


def test_save_checkpoint_in_peft_format(tmp_path):
    (checkpoint_file,) = write_pt_checkpoint(tmp_path / "checkpoint_dir", layers=1)
    ckpt = checkpointer([checkpoint_file], tmp_path)
    state_dict = ckpt.load_checkpoint()
    model = lora_model(checkpoint_file.parent, state_dict)
    expected_adapter_state_dict = torchtune_adapter(model)
    state_dict.update({"adapter": expected_adapter_state_dict, "adapter_config": dict(TORCHTUNE_ADAPTER_CONFIG)})
    out = ckpt.save_checkpoint(state_dict, epoch=1)

    actual_adapter_state_dict = read_tensors(out / ADAPTER_MODEL)
    adapter_config = json.loads((out / ADAPTER_CONFIG_FILE).read_text())
    assert sorted(adapter_config["target_modules"]) == ["down_proj", "gate_proj", "lm_head", "o_proj", "q_proj", "up_proj"]
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8 and adapter_config["peft_type"] == "LORA"
    assert (out / checkpoint_file.name).is_file()  # the model beside it, as torchtune writes both

    # Map PEFT keys back to torchtune's (which are ours but for lora_a/lora_b), as torchtune's test does
    peft_to_tt = {"o_proj": "output_proj", "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3", "lm_head": "output"}
    assert len(actual_adapter_state_dict) == len(expected_adapter_state_dict)
    for k in actual_adapter_state_dict:
        new_k = k.replace("base_model.model.", "").replace("self_attn", "attn")
        if "lm_head" not in new_k:
            new_k = new_k.replace("model.", "")
        for kk, vv in peft_to_tt.items():
            if kk in k:
                new_k = new_k.replace(kk, vv)
        new_k = new_k.replace("lora_A", "lora_a").replace("lora_B", "lora_b")
        if "lora_b" in new_k and "q_proj" in new_k:
            # LoRA B of q is RoPE-permuted along its rows (as HF permutes q), so only its row sums match
            assert not torch.allclose(actual_adapter_state_dict[k], expected_adapter_state_dict[new_k])
            torch.testing.assert_close(actual_adapter_state_dict[k].sum(dim=0), expected_adapter_state_dict[new_k].sum(dim=0))
        else:  # torchtune checks the lora_a ones; the unpermuted lora_b ones match exactly as well
            torch.testing.assert_close(actual_adapter_state_dict[k], expected_adapter_state_dict[new_k])


# -- TestHFGemmaFullModelCheckpointer -----------------------------------------------------------------------------------
def test_gemma_load_save_checkpoint_single_file(tmp_path):
    """Gemma ties lm_head to the embedding: the checkpoint has no lm_head, and none is written back."""
    write_family_checkpoint(tmp_path / "checkpoint_dir", tiny_family_config("gemma"), max_shard_size="50MB")
    (checkpoint_file,) = sorted((tmp_path / "checkpoint_dir").glob("*.safetensors"))
    ckpt = HFCheckpointer(checkpoint_dir=tmp_path / "checkpoint_dir", checkpoint_files=[checkpoint_file],
                          model_type="GEMMA", output_dir=tmp_path / "output_dir")
    orig_state_dict = read_tensors(checkpoint_file)
    state_dict = ckpt.load_checkpoint()
    assert "lm_head.weight" not in orig_state_dict
    # By design: the native state dict names the tied head too (output.weight, the embedding's tensor), where
    # torchtune's has one key fewer; the files hold the same keys either way
    assert len(state_dict["model"].keys()) == len(orig_state_dict.keys()) + 1
    assert state_dict["model"]["output.weight"] is state_dict["model"]["tok_embeddings.weight"]
    for key in orig_state_dict:
        assert key in ckpt.layout.weight_map
    loads_into_the_model(tmp_path / "checkpoint_dir", state_dict)
    out = ckpt.save_checkpoint(state_dict, epoch=1)
    output_state_dict = read_tensors(out / checkpoint_file.name)  # by design: the input's file name in step_1/
    assert len(output_state_dict.keys()) == len(orig_state_dict.keys())


# -- test_checkpointer_utils.py ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("weights_only", [True, False])
def test_safe_torch_load(tmp_path, weights_only):
    """torchtune's safe_torch_load; ours is read_tensors (memory-mapped, always weights only)."""
    checkpoint_file = tmp_path / "model_checkpoint_01.pt"
    torch.save({"token_embeddings.weight": torch.ones(1, 10), "output.weight": torch.ones(1, 10)}, checkpoint_file)
    state_dict = read_tensors(checkpoint_file)
    assert "token_embeddings.weight" in state_dict and "output.weight" in state_dict
    assert state_dict["token_embeddings.weight"].shape[1] == 10
    assert state_dict["output.weight"].shape[0] == 1


# TestFormattedCheckpointFiles: torchtune's FormattedCheckpointFiles.from_dict(d).build_checkpoint_filenames() is
# waypoint.checkpointers.shard_layout.formatted_files(d); its ValueErrors are one-line CheckpointErrors
def formatted_files(spec):
    from waypoint.checkpointers.shard_layout import formatted_files as expand

    return expand(spec)


def test_invalid_from_dict_no_filename_format():
    with pytest.raises(CheckpointError, match="needs exactly filename_format and max_filename.*lacks filename_format"):
        formatted_files({"bad_key": "model_{}_of_{}.pt", "max_filename": "0005"})


def test_invalid_from_dict_int_max_filename():
    # YAML reads an unquoted 00025 as a number (octal here): its zero padding is lost, so a number is refused
    with pytest.raises(CheckpointError, match="max_filename=21: expected the last file's number as a quoted string"):
        formatted_files({"filename_format": "model_{}_of_{}.pt", "max_filename": 0o00025})


def test_invalid_filename_format():
    with pytest.raises(CheckpointError, match="exactly two {} placeholders"):
        formatted_files({"filename_format": "invalid_format_{}.pt", "max_filename": "0005"})


def test_build_checkpoint_filenames():
    expected = [f"model_{i:04d}_of_0012.pt" for i in range(1, 13)]
    assert formatted_files({"filename_format": "model_{}_of_{}.pt", "max_filename": "0012"}) == expected


# TestCheckOutdirNotInCkptdir: torchtune's check_outdir_not_in_ckptdir is the recipes' check_inputs_apart (an
# output_dir inside what a run reads is refused before anything is written)
@pytest.mark.parametrize("ckpt,out,refused", [
    ("path/to/ckpt", "path/to/output", False),  # sibling directories
    ("path/to/output/ckpt_dir", "path/to/output", False),  # the checkpoint inside output_dir (not inside a step_N)
    ("path/to/ckpt", "path/to/ckpt", True),  # the same directory
    ("path/to/ckpt", "path/to/ckpt/subdir", True),  # output_dir inside the checkpoint
    ("path/to/ckpt", "path/to/ckpt/subdir/another_subdir", True),  # a few levels down
])
def test_check_outdir_not_in_ckptdir(tmp_path, ckpt, out, refused):
    from waypoint.run.output_dir import check_inputs_apart

    if refused:  # torchtune: "cannot be the same as or a subdirectory of the checkpoint directory"
        with pytest.raises(CheckpointError, match="which the run reads; choose an output_dir outside it"):
            check_inputs_apart(tmp_path / out, {"checkpointer.checkpoint_dir": tmp_path / ckpt})
    else:
        check_inputs_apart(tmp_path / out, {"checkpointer.checkpoint_dir": tmp_path / ckpt})


# -- torchtune's checkpointer section, as its configs write it -----------------------------------------------------------
@pytest.fixture
def hf_checkpoint(tmp_path):
    write_hf_checkpoint(tmp_path / "in", tiny_llama_config(), max_shard_size="60KB")
    return tmp_path / "in"


def test_formatted_checkpoint_files_read_as_torchtune_expands_them(hf_checkpoint, tmp_path):
    files = sorted(p.name for p in hf_checkpoint.glob("model-*.safetensors"))
    last = files[-1].split("-of-")[1].removesuffix(".safetensors")
    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "out",
                          checkpoint_files={"filename_format": "model-{}-of-{}.safetensors", "max_filename": last})
    assert sorted(ckpt.files) == files  # the index json covers them: its key -> file map, in its order
    ckpt.load_checkpoint()
    assert set(ckpt.layout.weight_map.values()) == set(files)
    with pytest.raises(CheckpointError, match="model-00001-of-00009.safetensors: weight file not found"):
        HFCheckpointer(hf_checkpoint, tmp_path / "out",
                       checkpoint_files={"filename_format": "model-{}-of-{}.safetensors", "max_filename": "00009"})


def test_absolute_checkpoint_files_inside_checkpoint_dir_are_accepted_outside_refused(hf_checkpoint, tmp_path):
    files = sorted(hf_checkpoint.glob("model-*.safetensors"))
    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "out", checkpoint_files=[str(f) for f in files])
    assert sorted(ckpt.files) == [f.name for f in files]  # relative names, in the index json's order
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(files[0].read_bytes())
    with pytest.raises(CheckpointError, match="escapes the checkpoint directory"):
        HFCheckpointer(hf_checkpoint, tmp_path / "out", checkpoint_files=[str(outside)])


@pytest.mark.parametrize("cls", [HFCheckpointer, MetaCheckpointer, NativeCheckpointer])
def test_torchtune_resume_options_null_or_false_say_nothing(cls, tmp_path, meta_and_native):
    ckpt = cls(meta_and_native[cls.name], tmp_path / "out", recipe_checkpoint=None, adapter_checkpoint=None,
               resume_from_checkpoint=False, should_load_recipe_state=False)
    ckpt.load_checkpoint()
    assert ckpt.notes == []


@pytest.mark.parametrize("cls", [HFCheckpointer, MetaCheckpointer, NativeCheckpointer])
def test_torchtune_resume_options_given_say_what_waypoint_does_in_one_note(cls, tmp_path, meta_and_native):
    ckpt = cls(meta_and_native[cls.name], tmp_path / "out", recipe_checkpoint="/tmp/recipe_state/recipe_state.pt",
               resume_from_checkpoint=True, adapter_checkpoint=None)
    ckpt.load_checkpoint()
    (note,) = ckpt.notes
    assert note.startswith("note: checkpointer.recipe_checkpoint, checkpointer.resume_from_checkpoint (torchtune's resume options) unused")
    assert "resume=auto" in note and "step_N/recipe_state.pt" in note and "\n" not in note


@pytest.fixture
def meta_and_native(hf_checkpoint, tmp_path):
    """The tiny HF checkpoint, and the same model converted to Meta's and the native format."""
    from waypoint.checkpointers import convert

    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "unused")
    state = ckpt.load_checkpoint()
    return {"hf": hf_checkpoint, "meta": convert(ckpt, state, "meta", tmp_path / "meta"),
            "native": convert(ckpt, state, "native", tmp_path / "native")}


def test_meta_and_native_take_torchtune_checkpoint_files(meta_and_native, tmp_path):
    meta = meta_and_native["meta"]
    ckpt = MetaCheckpointer(meta, tmp_path / "out", checkpoint_files=[str(meta / "consolidated.00.pth")], model_type="LLAMA3")
    assert ckpt.files == ("consolidated.00.pth",)
    ckpt.save_checkpoint(ckpt.load_checkpoint(), epoch=1)
    assert (tmp_path / "out" / "step_1" / "consolidated.00.pth").is_file()  # by design: not epoch_1/
    with pytest.raises(CheckpointError, match="consolidated.1-of-2.pth: weight file not found"):  # expanded, then checked
        MetaCheckpointer(meta, tmp_path / "out", checkpoint_files={"filename_format": "consolidated.{}-of-{}.pth", "max_filename": "2"})
    native = NativeCheckpointer(meta_and_native["native"], tmp_path / "out2", model_type="LLAMA2")  # torchtune's key: checked
    native.load_checkpoint()
    with pytest.raises(CheckpointError, match="checkpointer.model_type=QWEN3: .* records a LLAMA2 model"):
        NativeCheckpointer(meta_and_native["native"], tmp_path / "out2", model_type="QWEN3")


# -- save_checkpoint as torchtune's loops call it -------------------------------------------------------------------------
def test_save_checkpoint_takes_torchtune_epoch_as_the_step(hf_checkpoint, tmp_path):
    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "out")
    state = ckpt.load_checkpoint()
    assert ckpt.save_checkpoint(state, epoch=3) == tmp_path / "out" / "step_3"
    with pytest.raises(CheckpointError, match="save_checkpoint: step=4 and epoch=5; give one"):
        ckpt.save_checkpoint(state, 4, epoch=5)
    with pytest.raises(CheckpointError, match=r"save_checkpoint: step=None: expected an integer >= 0 \(step=N, or torchtune's epoch=N\)"):
        ckpt.save_checkpoint(state)


def test_recipe_state_entries_are_written_with_intermediate_checkpoint_refused_without(hf_checkpoint, tmp_path):
    """torchtune writes the entries beside the model as output_dir/recipe_state/recipe_state.pt with
    intermediate_checkpoint=True and drops them silently without; ours writes them into the step as recipe_state.pt
    (committed with it) and refuses them in one line without."""
    from waypoint.run.recipe_state import load_recipe_state

    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "out")
    state = ckpt.load_checkpoint()
    extras = {"optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]}, "epochs_run": 1, "seed": 7}
    with pytest.raises(CheckpointError, match="entries 'optimizer', 'epochs_run', 'seed' are neither the model nor a "
                                              "LoRA adapter; pass intermediate_checkpoint=True"):
        ckpt.save_checkpoint({**state, **extras}, epoch=1)
    assert not (tmp_path / "out" / "step_1").exists()
    out = ckpt.save_checkpoint({**state, **extras}, epoch=1, intermediate_checkpoint=True)
    assert torch.load(out / "recipe_state.pt", weights_only=True) == extras
    assert "recipe_state.pt" in json.loads((out / "MANIFEST.json").read_text())["files"]
    # a Waypoint recipe pointed at it says whose state it is, in one line
    with pytest.raises(CheckpointError, match="not a Waypoint recipe's state .*resume it with that loop"):
        load_recipe_state(out)


def test_adapter_entries_are_written_or_refused_never_dropped(hf_checkpoint, tmp_path):
    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "out")
    state = ckpt.load_checkpoint()
    model = lora_model(hf_checkpoint, state, targets=("q_proj", "v_proj"))
    adapter = torchtune_adapter(model)
    with pytest.raises(CheckpointError, match=r"state_dict\['adapter'\] needs state_dict\['adapter_config'\]"):
        ckpt.save_checkpoint({**state, "adapter": adapter}, epoch=1)
    with pytest.raises(CheckpointError, match=r"state_dict\['adapter_config'\] without state_dict\['adapter'\]"):
        ckpt.save_checkpoint({**state, "adapter_config": TORCHTUNE_ADAPTER_CONFIG}, epoch=1)
    with pytest.raises(CheckpointError, match=r"adapter_config'\] r=8, but the adapter's lora_A weights have rank 4"):
        ckpt.save_checkpoint({**state, "adapter": adapter, "adapter_config": {"r": 8, "lora_alpha": 16}}, epoch=1)
    with pytest.raises(CheckpointError, match=r"\['layers.0.attn.q_proj.magnitude'\] is not a LoRA A/B weight"):
        ckpt.save_checkpoint({**state, "adapter": {**adapter, "layers.0.attn.q_proj.magnitude": torch.ones(64)},
                              "adapter_config": {"r": 4, "lora_alpha": 8}}, epoch=1)
    assert not (tmp_path / "out" / "step_1").exists()


def test_saved_adapter_loads_in_peft_as_the_lora_model_computes(hf_checkpoint, tmp_path, tokens):
    """The oracle beyond torchtune's key checks: PEFT reads the adapter save_checkpoint wrote onto the base
    transformers model, and computes what the LoRA model computes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt = HFCheckpointer(hf_checkpoint, tmp_path / "out")
    state = ckpt.load_checkpoint()
    model = lora_model(hf_checkpoint, state).eval()
    out = ckpt.save_checkpoint({"adapter": torchtune_adapter(model), "adapter_config": TORCHTUNE_ADAPTER_CONFIG},
                               epoch=1, adapter_only=True)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_checkpoint), out).eval()
    with torch.no_grad():
        assert (peft(tokens).logits - model(tokens)).abs().max().item() <= 1e-4


# -- the config: _component_ and torchtune's checkpointer components --------------------------------------------------------
TORCHTUNE_SECTION = """
checkpointer:
  _component_: {component}
  checkpoint_dir: {checkpoint_dir}
  checkpoint_files:
    filename_format: model-{{}}-of-{{}}.safetensors
    max_filename: "00003"
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA3_2
resume_from_checkpoint: False
"""


def torchtune_config(tmp_path: Path, component: str = "torchtune.training.FullModelHFCheckpointer", extra: str = "") -> Path:
    """configs/tiny.yaml with its checkpointer section as torchtune 0.6.1's llama3_2/1B_full_single_device.yaml
    writes it (the tiny asset's three shards in its filename_format form)."""
    text = (ROOT / "configs/tiny.yaml").read_text()
    text = text.replace("  - checkpointer: hf   # checkpointer=meta / checkpointer=native switch the format\n", "")
    text = text.replace("checkpointer:\n  checkpoint_dir: assets/tiny_llama\n",
                        TORCHTUNE_SECTION.format(component=component, checkpoint_dir=ROOT / "assets/tiny_llama"))
    path = tmp_path / "torchtune_style.yaml"
    path.write_text(text + extra)
    return path


def test_torchtune_checkpointer_section_composes_and_instantiates(tmp_path, capsys):
    from hydra.utils import instantiate

    from waypoint.cli.config import parse_config

    cfg = parse_config(["--config", str(torchtune_config(tmp_path)), f"output_dir={tmp_path / 'run'}"])
    assert capsys.readouterr().out.splitlines() == [
        "note: _component_ (torchtune's name) read as _target_ in checkpointer "
        "(torchtune.training.FullModelHFCheckpointer -> waypoint.checkpointers.HFCheckpointer)"]
    assert cfg.checkpointer._target_ == "waypoint.checkpointers.HFCheckpointer" and "_component_" not in cfg.checkpointer
    ckpt = instantiate(cfg.checkpointer)
    assert isinstance(ckpt, HFCheckpointer) and len(ckpt.files) == 3 and ckpt.notes == []  # recipe_checkpoint: null
    assert OmegaConf.to_container(cfg.checkpointer.checkpoint_files) == {"filename_format": "model-{}-of-{}.safetensors",
                                                                        "max_filename": "00003"}


@pytest.mark.parametrize("component,target", [
    ("torchtune.training.FullModelMetaCheckpointer", "waypoint.checkpointers.MetaCheckpointer"),
    ("torchtune.training.checkpointing.FullModelTorchTuneCheckpointer", "waypoint.checkpointers.NativeCheckpointer"),
    ("waypoint.checkpointers.HFCheckpointer", "waypoint.checkpointers.HFCheckpointer"),  # our own class, under _component_
])
def test_torchtune_checkpointer_components_map_to_ours(tmp_path, capsys, component, target):
    from waypoint.cli.config import parse_config

    cfg = parse_config(["--config", str(torchtune_config(tmp_path, component))])
    assert cfg.checkpointer._target_ == target
    (note,) = capsys.readouterr().out.splitlines()
    assert note.startswith("note: _component_ (torchtune's name) read as _target_ in checkpointer")


def test_a_torchtune_class_elsewhere_is_one_line_saying_what_to_write(tmp_path, capsys):
    from recipes.full_finetune import main

    config = torchtune_config(tmp_path)
    config.write_text(config.read_text().replace("  _target_: waypoint.checkpointers.build_model",
                                                 "  _component_: torchtune.models.llama3_2.llama3_2_1b"))
    with pytest.raises(SystemExit) as exit_:
        main(["--config", str(config), f"output_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 1 and "\n" not in err
    assert err == ("error: model._component_: torchtune.models.llama3_2.llama3_2_1b is torchtune's own, which Waypoint "
                   "does not use; write _target_: waypoint.checkpointers.build_model with checkpoint_dir: "
                   "${checkpointer.checkpoint_dir} (the model the checkpoint describes)")
    assert not (tmp_path / "run").exists()


def test_component_beside_another_target_is_refused(tmp_path, capsys):
    from waypoint.cli.config import parse_config

    config = torchtune_config(tmp_path, "torchtune.training.FullModelMetaCheckpointer")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(config), "+checkpointer._target_=waypoint.checkpointers.HFCheckpointer"])
    assert capsys.readouterr().err.strip() == (
        "error: checkpointer: both _target_ (waypoint.checkpointers.HFCheckpointer) and _component_ "
        "(torchtune.training.FullModelMetaCheckpointer) are given; keep one (a config group such as checkpointer: hf "
        "gives _target_)")


def test_top_level_resume_from_checkpoint_true_is_one_note(tmp_path, capsys):
    from waypoint.cli.config import parse_config

    parse_config(["--config", str(torchtune_config(tmp_path)), "resume_from_checkpoint=true",
                  "+optimizer._component_=torch.optim.AdamW", "~optimizer._target_"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("note: _component_ (torchtune's name) read as _target_ in checkpointer (torchtune.training."
                        "FullModelHFCheckpointer -> waypoint.checkpointers.HFCheckpointer), optimizer")
    assert lines[1].startswith("note: resume_from_checkpoint (torchtune's resume option) unused: a Waypoint run resumes")
    assert len(lines) == 2
