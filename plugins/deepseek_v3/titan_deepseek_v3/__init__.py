"""DeepSeek-V3 for titan-plugins: MLA + MoE, TorchTitan's definition and numerics.

Light on purpose (no torch): ``titan-plugins list`` imports the plugin module.
Import ``titan_deepseek_v3.model`` / ``.parallelize`` / ``.state_dict_adapter`` directly.
"""

__version__ = "0.1.0"
