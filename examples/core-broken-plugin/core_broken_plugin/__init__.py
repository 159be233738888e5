"""A deliberately broken core-serve plugin: importing it raises.

core-serve must skip it, list it under failures (with this distribution and the error) in
`core backends`, and refuse to start only when CORE_STRICT_PLUGINS=1.
"""

raise ImportError("this plugin is deliberately broken")
