"""Reports: gather facts from a trace or plan into plain data, then render them.

One module per subject and output format (``trace_text`` for a trace as text/JSON data;
plan reports live beside it). Gathering functions return JSON-ready dicts; renderers turn
them into text. Nothing here imports torch.
"""
