"""The DeepSeek-V4 model: ``args`` (its arguments), ``model`` (single device), ``training`` (the objective,
recomputation), ``parallelize`` (its parallel plan), ``stage`` (the objective of one pipeline stage under
TP / SP), ``state_dict_adapter`` (checkpoint names)."""
