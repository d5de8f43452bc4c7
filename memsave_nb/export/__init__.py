"""Code generation: reads a plan and writes text (``pytorch.py``: ``Plan.to_code``'s snippet).

Below the plan: it never imports ``plan.py`` (the plan calls it), nor ``parallel/``, ``planner/``,
``ui/`` or ``cli/``.
"""

from .pytorch import plan_code

__all__ = ["plan_code"]
