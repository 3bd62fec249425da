"""Shared pytest set-up: one torch thread in the test process, so forked gloo ranks never hang."""

import os
import sys

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
