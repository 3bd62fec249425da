"""The flag lines of three real Megatron-LM launch scripts, shared by the parse test
(tests/unit/test_megatron_scripts.py) and the start test (tests/smoke/test_megatron_scripts_start.py).

The flag lists below were checked flag by flag against the scripts in NVIDIA/Megatron-LM
(examples/pretrain_gpt_distributed_with_mp.sh at 090e141, examples/pretrain_gpt3_175B.sh at
090e141, examples/gpt3/train_gpt3_175b_distributed.sh at 157006d), read through the project's
public-code reference index; shell variables are kept as placeholders that PATHS replaces.
"""

PATHS = {"$DATA_PATH": "my-gpt2_text_document", "$VOCAB_FILE": "gpt2-vocab.json",
         "$MERGE_FILE": "gpt2-merges.txt", "$CHECKPOINT_PATH": "checkpoints/gpt",
         "$TENSORBOARD_LOGS_PATH": "tensorboard/gpt", "$DATASET_1": "web_text_document",
         "$DATASET_2": "books_text_document", "$DATASET_3": "wiki_text_document"}

# examples/pretrain_gpt_distributed_with_mp.sh (torch.distributed.launch, 8 GPUs: TP 2, PP 2)
DISTRIBUTED_WITH_MP = """
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 24 --hidden-size 1024
--num-attention-heads 16 --micro-batch-size 4 --global-batch-size 16 --seq-length 1024
--max-position-embeddings 1024 --train-iters 500000 --lr-decay-iters 320000
--save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --data-path $DATA_PATH --vocab-file $VOCAB_FILE
--merge-file $MERGE_FILE --data-impl mmap --split 949,50,1 --distributed-backend nccl --lr 0.00015
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--lr-warmup-fraction .01 --checkpoint-activations --log-interval 100 --save-interval 10000
--eval-interval 1000 --eval-iters 10 --fp16
"""

# examples/pretrain_gpt3_175B.sh (samples-based, batch-size ramp-up; 1024 GPUs: TP 8, PP 16)
GPT3_175B = """
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --num-layers 96
--hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
--train-samples 146484375 --lr-decay-samples 126953125 --lr-warmup-samples 183105 --lr 6.0e-5
--min-lr 6.0e-6 --lr-decay-style cosine --log-interval 10 --eval-iters 40 --eval-interval 1000
--data-path 0.2 $DATASET_1 0.3 $DATASET_2 0.5 $DATASET_3 --vocab-file $VOCAB_FILE
--merge-file $MERGE_FILE --save-interval 1000
--save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --split 98,2,0 --clip-grad 1.0 --weight-decay 0.1
--adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006
--tensorboard-dir $TENSORBOARD_LOGS_PATH --fp16 --checkpoint-activations
"""

# examples/gpt3/train_gpt3_175b_distributed.sh (torchrun; TP 8, PP 16)
GPT3_175B_DISTRIBUTED = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto
--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375
--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path $DATA_PATH --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save $CHECKPOINT_PATH
--load $CHECKPOINT_PATH --eval-iters 10 --tensorboard-dir $TENSORBOARD_LOGS_PATH
"""

SCRIPTS = {"pretrain_gpt_distributed_with_mp": DISTRIBUTED_WITH_MP,
           "pretrain_gpt3_175B": GPT3_175B,
           "train_gpt3_175b_distributed": GPT3_175B_DISTRIBUTED}


def script_argv(text: str) -> list[str]:
    return [PATHS.get(token, token) for token in text.split()]


def with_value(argv: list[str], flag: str, value: str) -> list[str]:
    result = list(argv)
    result[result.index(flag) + 1] = value
    return result




def flag_groups(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``argv`` as (flag, its values) pairs, in order."""
    groups = []
    for token in argv:
        if token.startswith("--"):
            groups.append((token, []))
        else:
            groups[-1][1].append(token)
    return groups


def overridden(argv: list[str], values: dict, drop: tuple = ()) -> list[str]:
    """``argv`` with the values of the flags in ``values`` replaced (a flag not in ``argv`` is
    appended), and the flags in ``drop`` removed with their values."""
    result, seen = [], set()
    for flag, flag_values in flag_groups(argv):
        if flag in drop:
            continue
        seen.add(flag)
        result += [flag, *(values[flag].split() if flag in values else flag_values)]
    for flag, value in values.items():
        if flag not in seen:
            result += [flag, *value.split()]
    return result
