"""The Chimera paper's GPT-2 runs (Li & Hoefler, SC'21, §5) as data: each configuration as the
authors ran it and each published number with where it was transcribed from.

Configurations come from the authors' job scripts (github.com/Shigangli/Chimera, branch
ChimeraBk; ``script`` names the file) or, where no script is published, from the paper's text
as restated in /work/shared/reference/chimera.md §8 (``script`` says so). Published numbers are
transcribed, never recomputed: throughputs read off the paper's plots (reference note §8),
speedups and efficiencies as the paper states them. Nothing here is a prediction.
"""

from __future__ import annotations

from dataclasses import dataclass

SCRIPTS = "github.com/Shigangli/Chimera@ChimeraBk"
REFERENCE = "chimera.md §8 (read off the paper's plots)"


@dataclass(frozen=True)
class PaperRun:
    """One measured configuration: ``scheme`` of the performance model, W replicas of a
    D-stage pipeline, micro-batch B, N micro-batches per replica per weight update,
    recomputation, the published sequences/s and the sources of both."""

    label: str
    scheme: str
    data_parallel: int
    pipeline: int
    micro_batch_size: int
    num_microbatches: int
    recompute: str
    published: float
    script: str
    source: str = REFERENCE

    @property
    def nodes(self) -> int:
        return self.data_parallel * self.pipeline

    @property
    def global_batch_size(self) -> int:
        return self.data_parallel * self.micro_batch_size * self.num_microbatches


_CHIMERA_32 = (f"{SCRIPTS} chimera/chimera_gpt2/gpt2/job_scripts/"
               "daint_gpt2_chimera_512nodes_16w32d.sh (D=32, B=1, no --recompute_step)")
_CHIMERA_8 = (f"{SCRIPTS} chimera/chimera_gpt2/gpt2/job_scripts/"
              "daint_gpt2_chimera_direct_512nodes.sh (D=8, B=1, --recompute_step; it also "
              "passes --gradient_accumulation_steps 3, i.e. N = 24 per update and a mini-batch "
              "of 1,536, which is not the sweep's 512: the sweep row keeps N = 8 from the "
              "paper's mini-batch)")
_NO_SCRIPT = "no job script published; configuration from the paper (chimera.md §8)"

#: GPT-2, 512 nodes, mini-batch 512: the (W, D) sweep (chimera.md §8, "measured").
SWEEP_512 = (
    PaperRun("W=8 D=64", "chimera-direct", 8, 64, 1, 64, "none", 117, _NO_SCRIPT),
    PaperRun("W=16 D=32", "chimera-direct", 16, 32, 1, 32, "none", 140, _CHIMERA_32),
    PaperRun("W=32 D=16 recompute", "chimera-direct", 32, 16, 1, 16, "full", 129, _NO_SCRIPT),
    PaperRun("W=64 D=8 recompute", "chimera-direct", 64, 8, 1, 8, "full", 143, _CHIMERA_8),
)

#: GEMS's update: ``--gradient_accumulation_steps 6`` steps, each one micro-batch of the down
#: and one of the up replica (main_with_runtime_gems.py: update_interval = 1 x accumulation).
GEMS_ACCUMULATION_STEPS = 6
GEMS_MICROBATCHES = 2 * GEMS_ACCUMULATION_STEPS

#: GPT-2, 2,048 nodes, mini-batch 2,048 (GEMS: its script's update, see above): Chimera and
#: the five baselines, each as run.
COMPARISON_2048 = (
    PaperRun("Chimera", "chimera-direct", 64, 32, 1, 32, "none", 513, _CHIMERA_32),
    PaperRun("PipeDream-2BW", "pipedream-2bw", 128, 16, 1, 16, "full", 440,
             f"{SCRIPTS} baselines/gpt2_pipedream2bw/gpt2/job_scripts/"
             "gpt2_512nodes_32w16d_pipedream2bw.sh (models.depth=16, --train_batch_size 1, "
             "--gradient_accumulation_steps 1 -> update_interval = D = 16, 2 weight versions, "
             "--recompute_step)"),
    PaperRun("1F1B/DAPPLE", "1f1b", 128, 16, 1, 16, "full", 372, _NO_SCRIPT),
    PaperRun("GPipe", "gpipe", 256, 8, 1, 8, "full", 361, _NO_SCRIPT),
    PaperRun("PipeDream", "pipedream", 256, 8, 2, 4, "full", 256,
             f"{SCRIPTS} baselines/gpt2_pipedream2bw/gpt2/job_scripts/"
             "gpt2_512nodes_64w8d_pipedream.sh (models.depth=8, --train_batch_size 2, "
             "--recompute_step, --pipedream -> update_interval = 1, D - r weight versions)"),
    PaperRun("GEMS", "gems", 256, 8, 2, GEMS_MICROBATCHES, "none", 220,
             f"{SCRIPTS} baselines/gpt2_gems/gpt2/job_scripts/gems_64w8d_2b_gpt2.sh "
             "(models.depth=8, --train_batch_size 2, no --recompute_step, "
             "--gradient_accumulation_steps 6 -> update_interval = 6 steps of one down and "
             "one up micro-batch: N = 12 per update, mini-batch 256 x 2 x 12 = 6,144; the "
             "throughput is per sequence, so the larger update only amortises the sync)"),
)

#: Chimera D=32, B=1, N=32 at 512, 1,024, 2,048 nodes (the 512 and 2,048 points are the sweep's
#: W=16 row and the comparison's Chimera row: the same measurements).
WEAK_SCALING = (
    PaperRun("512 nodes", "chimera-direct", 16, 32, 1, 32, "none", 140, _CHIMERA_32),
    PaperRun("1,024 nodes", "chimera-direct", 32, 32, 1, 32, "none", 279, _CHIMERA_32),
    PaperRun("2,048 nodes", "chimera-direct", 64, 32, 1, 32, "none", 513, _CHIMERA_32),
)

#: Published speedups of Chimera over each baseline at 2,048 nodes (paper abstract: 1.16x-2.34x;
#: per baseline: chimera.md §8 table). Transcribed, not derived from the seq/s above.
PUBLISHED_SPEEDUPS = {"PipeDream-2BW": 1.16, "1F1B/DAPPLE": 1.38, "GPipe": 1.42,
                      "PipeDream": 2.01, "GEMS": 2.34}
SPEEDUP_SOURCE = "paper abstract (1.16x-2.34x) and chimera.md §8 table"

#: Weak-scaling efficiency 512 -> 2,048 nodes as stated (chimera.md §8).
PUBLISHED_WEAK_SCALING_EFFICIENCY = 0.914
WEAK_SCALING_SOURCE = "chimera.md §8 ('91.4% efficiency')"

#: Bert-48 weak scaling, Chimera D=4, B=8, N=8 (chimera.md §8: 16/32/64 nodes ≈89/≈174/≈341
#: seq/s). Not fitted: an out-of-sample check of the constants inside one dragonfly group.
BERT48_WEAK_SCALING = tuple(
    PaperRun(f"Bert-48 {nodes} nodes", "chimera-direct", nodes // 4, 4, 8, 8, "none", published,
             "configuration from chimera.md §8 (D=4, B=8, N=8); the authors' 32-node script "
             f"{SCRIPTS} chimera/chimera_bert/bert/job_scripts/"
             "daint_bert48_chimera_32nodes_8w4d_8b_4s.sh runs D=4, B=8 with "
             "--gradient_accumulation_steps 4")
    for nodes, published in ((16, 89), (32, 174), (64, 341)))

#: Chimera's speedup over PipeDream-2BW, Bert-48 at 64 nodes (chimera.md §8: "at 64 nodes 1.19x
#: over 1F1B, 1.32x over GPipe, 1.17x over PipeDream-2BW"). Transcribed; never fitted.
BERT48_SPEEDUP_OVER_PIPEDREAM_2BW_64 = 1.17
#: PipeDream-2BW's Bert-48 run as the authors' only Bert-48 2BW script sets it (32 nodes: 4 x 8,
#: B=16, --recompute_step, --gradient_accumulation_steps 1 -> update_interval = D = 8), at 64
#: nodes by doubling W (the script's width is the only thing changed; no 64-node script is
#: published).
BERT48_PIPEDREAM_2BW_64 = PaperRun(
    "Bert-48 PipeDream-2BW 64 nodes", "pipedream-2bw", 8, 8, 16, 8, "full", 0,
    f"{SCRIPTS} baselines/bert_pipedream2bw/bert/job_scripts/"
    "daint_bert48_32nodes_pipedream2bw_4wx8d_16b.sh (models.bert48.depth=8, "
    "--train_batch_size 16, --recompute_step, --gradient_accumulation_steps 1; 4 x 8 at 32 "
    "nodes, W doubled to 8 for 64 nodes)",
    "no seq/s published; the speedup above is")

#: eager-sync-opt over eager-sync, Bert-48, Chimera D=4, B=8, N=8 (chimera.md §8).
SYNC_POLICY = ((16, 1.01), (32, 1.09), (64, 1.10))
SYNC_POLICY_SOURCE = "chimera.md §8 (gradient sync: 1.01x, 1.09x, 1.10x at 16, 32, 64 nodes)"

#: The 512-node sweep's best measured configuration (chimera.md §8: (64, 8, recompute) 143
#: measured; the paper's own model ranked (16, 32) first: 149 vs 143).
SWEEP_BEST_MEASURED = "W=64 D=8 recompute"
#: The paper's own performance model on the same sweep (chimera.md §8, "measured / model": the
#: second number of each pair), transcribed: seq/s per sweep row.
SWEEP_512_PAPERS_MODEL = {"W=8 D=64": 128, "W=16 D=32": 149, "W=32 D=16 recompute": 138,
                          "W=64 D=8 recompute": 143}
#: The paper's choice at 2,048 nodes.
PAPER_CHOICE_2048 = {"scheme": "chimera", "W": 64, "D": 32}
