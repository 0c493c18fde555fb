"""Allocators: how many tokens each layer and head keeps (docs/algorithms.md §2).

Every allocator is a pure function returning int32 *selectable* budgets on the device (callers
add the protected count ``sink + window``), plus an allocator object for ``compress()``::

    alloc = tritonkv.allocation.get_allocator("adakv")      # or AdaKV(alpha=0.2), Pyramid(beta=20), ...
    budgets = alloc(scores=scores, budget=b, sink=4, window=32, layer=3, num_layers=30)   # int32 [B, H]

Exact mode (the default) hits the requested total with largest-remainder rounding
(``rounding.largest_remainder``); paper modes reproduce each source's rounding.

=============  =====================================================  ==============================
name           rule                                                   reads
=============  =====================================================  ==============================
uniform        ``min(b, avail)`` everywhere                           shapes
pyramid        PyramidKV linear ramp over layers (β = 20)             layer, num_layers
adakv          global top-H·b over a layer's heads, ⌊α·b⌋ safeguard  scores
headkv         fixed + pool split by an offline profile (β = 1.5)     profile, layer
surfacelogic   fixed + pool by INF layer × head importance (ρ=1.351)  profile (or shipped), layer
score          SCORE redundancy: layers by IR + TD, heads by HD·T     head_means, layer, scores
cake           CAKE dispersion × shift layer preference               layer_preference, layer
fixed          precomputed budgets                                    layer
=============  =====================================================  ==============================

Tensor parallel (``process_group=``, ``tritonkv.distributed``): every rank computes every head's budgets and keeps
its own. Allocators that read only shapes and replicated inputs (uniform, pyramid, headkv, surfacelogic, cake,
fixed: ``tp_mode = "replicated"``) communicate nothing; adakv gathers each head's top ``min(avail, H·b)`` scores and
score the layer's scores, one all-gather per layer; the budgets equal the single-process ones.
"""
from .adakv import AdaKV, adakv_budgets
from .base import ALLOCATORS, Allocator, get_allocator, register_allocator
from .cake import Cake, Fixed, cake_budgets, cake_preference
from .headkv import HeadKV, headkv_budgets
from .pyramid import Pyramid, pyramid_budgets
from .rounding import adjust_budgets, largest_remainder
from .score import (Score, head_distance, head_means, head_means_from_queries, redundancy, sample_positions,
                    score_budgets, score_head_budgets, score_layer_budgets)
from .surfacelogic import SurfaceLogic, surfacelogic_budgets
from .uniform import Uniform, uniform_budgets

__all__ = ["ALLOCATORS", "Allocator", "get_allocator", "register_allocator", "largest_remainder", "adjust_budgets",
           "Uniform", "uniform_budgets", "Pyramid", "pyramid_budgets", "AdaKV", "adakv_budgets",
           "HeadKV", "headkv_budgets", "SurfaceLogic", "surfacelogic_budgets", "Score", "score_budgets",
           "score_layer_budgets", "score_head_budgets", "redundancy", "head_distance", "head_means",
           "head_means_from_queries", "sample_positions", "Cake", "cake_budgets", "cake_preference", "Fixed"]
