"""Other engines' rules, kept apart from the production engine so a trace can replay under them on the same
plant (`--policy seed-static | fixed | vllm`): each baseline is a static policy whose `scheduler_class` holds
that engine's scheduling rules and whose `on_oom` is what that engine does when a step runs out of memory.
engine/factory.py picks one by name; the production scheduler and Limits carry none of their knobs."""
