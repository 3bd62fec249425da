"""Reasons shared by several Megatron flags that are ignored or rejected, one constant each, so that
the log line, ``--help`` and docs/flags.md say the same thing for all of them."""

NO_FUSED_KERNEL = "there is no fused CUDA kernel here to switch"
TENSORBOARD_SCALARS = ("TensorBoard receives this project's fixed set of scalars every "
                       "--log-interval iterations")
CHECKPOINT_FORMAT = ("the checkpoint format is chosen with --ckpt-format (torch_dist: global tensors "
                     "through torch.distributed.checkpoint, resumable in any layout; torch: one file "
                     "per rank); loading detects it (see docs/checkpointing.md)")
DIST_CHECKPOINT = ("--ckpt-format torch_dist always saves and loads fully in parallel and fully "
                   "reshardable: each rank writes one replica's share of every tensor and reads only "
                   "the pieces it needs, keyed by parameter name and global shape")
GARBAGE_COLLECTOR = "Python's garbage collector runs as usual"
PROFILER = "no built-in profiler; wrap the run in torch.profiler or nsys"
AUTORESUME = "no ADLR auto-resume service; use --exit-duration-in-mins with --save"
TIMERS = "timers synchronise the device, not the ranks (no barrier needed)"
TP_OVERLAP = ("tensor-parallel communication is not overlapped with the matrix multiplications "
              "(a performance switch)")
DP_COMMUNICATION = ("data-parallel gradients always use this project's contiguous-buffer "
                    "reduction (a performance switch)")
PIPELINE_P2P = ("pipeline transfers are this project's own point-to-point messages (see "
                "--p2p-packing); a performance switch")
STRAGGLER = ("there is no straggler detector; per-rank timings are in the timer block "
             "(--timing-log-option all)")
ONE_LOGGER = ("NVIDIA's internal one-logger tracking is not available; metrics go to the log, "
              "TensorBoard and Weights & Biases")
INFERENCE_SERVER = ("read only by Megatron's text-generation server, which training never runs "
                    "(generate text with tools/generate.py)")
MOE = "mixture of experts is not implemented"
FP8 = "FP8 training is not implemented"
RETRO = "retro (retrieval-augmented GPT) is not implemented"
VISION = "vision models are not implemented"
BIENCODER = "biencoder and ICT/REALM retrieval models are not implemented"
BERT = "BERT models are not implemented (this project trains GPT)"
ENCODER_DECODER = "encoder-decoder (T5) models are not implemented"
BERT_T5_DATA = "read only by Megatron's BERT, T5 and ICT datasets, which are not implemented"
ROTARY = "rotary embeddings are not implemented"
QUERY_GROUPS = "attention is multi-head (no query groups)"
EQUAL_STAGES = ("free-form stage layouts are not implemented (stages are even, or uneven with "
                "--decoder-first/last-pipeline-num-layers or --account-for-*-in-pipeline-split)")
CONSTANT_WEIGHT_DECAY = "weight decay is constant (--weight-decay)"
ONE_LEARNING_RATE = ("parameter groups with settings of their own are not implemented (only the "
                     "embedding and output layer's --decoupled-lr)")
ONE_DATA_PATH = "use --data-path with --split"
TOKENIZERS = ("only the GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
              "Llama2Tokenizer, HuggingFaceTokenizer and NullTokenizer tokenizers are implemented")
LR_DECAY = "only constant, linear and cosine learning-rate decay are implemented"

# Reasons first needed by the flags Megatron-LM added between 307dcf3 (May 2024) and d98e8a6
# (August 2026); see megatron/training/megatron_flags_recent.py.
CUDA_GRAPHS = ("there are no CUDA graphs here; every step launches its kernels as usual (the same "
               "computation)")
KERNELS = "a kernel or fusion choice; this project's PyTorch ops compute the same function"
MEMORY = ("activations and optimizer state stay on the device and are not offloaded or chunked "
          "(a memory-only switch; see --recompute-granularity to save memory)")
PROCESS_GROUPS = ("process groups are created with PyTorch's defaults (no flight recorder, no "
                  "extra gloo groups); a diagnostics or start-up switch")
FAULT_TOLERANCE = ("there is no in-process restart, fault-tolerance package or fault injector; "
                   "restart a failed run from its last checkpoint with --load")
DIAGNOSTICS = ("an extra diagnostic, dump or log channel that this project does not write; the "
               "training itself is unchanged")
HOUSEKEEPING = "a data-loading, storage or process housekeeping switch with no effect here"
MTP = "multi-token prediction is not implemented"
MLA = "multi-latent attention (and its YaRN rotary embeddings) is not implemented"
ATTENTION_VARIANT = ("attention is standard softmax multi-head attention; linear, windowed, "
                     "gated, sparse and other attention variants are not implemented")
HYBRID = "Mamba, hybrid and heterogeneous-layer models are not implemented"
CONTEXT_PARALLEL = "context parallelism is not implemented"
FSDP = "FSDP is not implemented (see --use-distributed-optimizer for sharded optimizer state)"
GTP = "weight sharding beyond tensor parallelism (GTP) is not implemented"
RL = "reinforcement-learning training (GRPO) is not implemented"
OTHER_OPTIMIZERS = "only the adam and sgd optimizers are implemented"
MHC = "hyper-connections (mHC) are not implemented"
DISTILLATION_SFT = "distillation and supervised fine-tuning datasets are not implemented"
WSD = "the WSD learning-rate schedule is not implemented"
TOKENIZER_OPTIONS = ("only the GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
                     "Llama2Tokenizer, HuggingFaceTokenizer and NullTokenizer are implemented, "
                     "without these options")
PRECISION_AWARE = ("the precision-aware optimizer is not implemented (the optimizer keeps fp32 "
                   "master weights and state)")
CKPT_CONVERT = ("converting checkpoints during training is not implemented; use "
                "tools/convert_checkpoint.py")
MLP_VARIANT = "the MLP activation is GeLU; other activations and their options are not implemented"
WEIGHT_DECAY_RULE = ("weight decay applies to weight matrices, never to biases and norms (use "
                     "--apply-wd-to-qk-layernorm for the query/key norms)")
EVALUATION_OPTIONS = ("evaluation runs --eval-iters batches every --eval-interval iterations, with "
                      "the training micro-batch size, on one validation set")
VOCAB_PADDING = "the vocabulary is always padded per --make-vocab-size-divisible-by"
SYNCHRONOUS_CHECKPOINT = ("--async-save writes the checkpoint in the background through "
                          "torch.distributed.checkpoint's async_save (--use-persistent-ckpt-worker: "
                          "in a writer process); there are no further tuning knobs")
NON_PERSISTENT_CHECKPOINT = ("only the checkpoints of --save every --save-interval are written; there "
                             "are no extra non-persistent (local or in-memory) ones")
CHECKPOINT_REPLICATION = ("checkpoint files are written once, to --save; they are not replicated to "
                          "other nodes")
