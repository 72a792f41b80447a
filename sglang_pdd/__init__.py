"""sglang-pdd: Prefill - RelayDecode - MainDecode across two datacenters, as an SGLang plugin.

Importing this package changes nothing in SGLang; the plugin is activated by SGLang's own
entry-point loader (group ``sglang.srt.plugins``), see ``sglang_pdd.sglang_glue``.
"""

__version__ = "0.1.0"
