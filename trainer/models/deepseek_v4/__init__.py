"""The DeepSeek-V4 model: ``args`` (its arguments), ``model`` (single device), ``parallelize`` (its parallel plan), ``state_dict_adapter`` (checkpoint names)."""
