"""A Llama-style model trained with Chimera on TP 2 x PP 2 with sequence parallelism (4 gloo ranks)
exports to Hugging Face ``LlamaForCausalLM`` with our logits (float32, 1e-4), imports back exactly,
and tools/generate.py and tools/evaluate.py run on its checkpoint."""

import json

import torch

import pretrain_gpt
from data_helpers import gpt2_corpus
from dist_harness import run_distributed
from inference_helpers import LLAMA
from megatron.inference.generation import full_logits
from megatron.inference.loading import load_model
from megatron.training.arguments import parse_args
from megatron.training.checkpoint_conversion import (TargetLayout, merge_full_state,
                                                     read_checkpoint)
from megatron.training.checkpointing import Checkpointer
from megatron.training.hf_checkpoint import export_to_hf, import_from_hf
from megatron.training.training import pretrain

MODEL = (f"{LLAMA} --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         f"--max-position-embeddings 16 --make-vocab-size-divisible-by 32 --seed 1234 "
         f"--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --train-iters 3 --eval-iters 0 "
         f"--split 80,20,0 --log-interval 1")
LAYOUT = ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --pipeline-schedule "
          "chimera --sequence-parallel")


def _train(rank, world_size, argv):
    config = parse_args(argv, world_size=world_size)
    pretrain_gpt.build_run_tokenizer(config)
    result = pretrain(config, pretrain_gpt.model_provider, pretrain_gpt.datasets_provider,
                      pretrain_gpt.forward_step,
                      checkpointing=Checkpointer(config, log=lambda _: None), log=lambda _: None)
    return [record.losses.get("lm loss") for record in result.history]


def test_llama_trained_with_chimera_tp2_pp2_sp_exports_imports_generates_and_evaluates(
        tmp_path, capsys):
    from transformers import LlamaForCausalLM
    data = gpt2_corpus(tmp_path)
    argv = f"{MODEL} {LAYOUT} --save {tmp_path / 'ckpt'}".split() + data
    losses = run_distributed(_train, 4, argv, timeout=300)
    assert all(loss is not None for loss in losses[0])  # Chimera: every rank reports the loss
    assert losses[0][-1] < losses[0][0]  # it trained

    export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), log=print)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == ["LlamaForCausalLM"]
    assert hf_config["num_key_value_heads"] == 2
    assert (tmp_path / "hf" / "vocab.json").is_file()  # the run's tokenizer travels along
    vocab = hf_config["vocab_size"]
    model, _ = load_model(str(tmp_path / "ckpt"))
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    hf_model = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        theirs = hf_model(tokens).logits
    ours = full_logits(model, tokens)[..., :vocab]
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=0)

    import_from_hf(str(tmp_path / "hf"), str(tmp_path / "back"), TargetLayout(),
                   make_vocab_size_divisible_by=32, log=print)
    trained = merge_full_state(read_checkpoint(str(tmp_path / "ckpt")))
    back = merge_full_state(read_checkpoint(str(tmp_path / "back")))
    assert back.keys() == trained.keys()
    for name, value in trained.items():
        rows = vocab if name in ("embedding.word_embeddings.weight", "output_layer.weight") \
            else None
        assert torch.equal(back[name][:rows], value[:rows]), name

    from tools.evaluate import main as evaluate
    from tools.generate import main as generate
    capsys.readouterr()
    assert generate(["--load", str(tmp_path / "ckpt"), "--prompt", "the cat", "--max-new-tokens",
                     "4", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
    assert evaluate(["--load", str(tmp_path / "ckpt"), "--task", "perplexity", "--device",
                     "cpu", "--num-samples", "4"]) == 0
    printed = {item.split()[0]: float(item.split()[1])
               for item in capsys.readouterr().out.split("|")}
    assert printed["samples"] == 4
    assert 1.0 < printed["perplexity"] < vocab  # trained: better than uniform over the vocabulary
