"""Integrations with training frameworks, each in its own module that imports the framework:
``taichi_plan.integrations.hf`` (the Hugging Face ``Trainer``; ``pip install taichi-plan[hf]``)."""
