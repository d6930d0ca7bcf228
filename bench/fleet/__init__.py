"""A fleet of twin replicas and its routers in virtual time (`headroom bench fleet`): `load` makes the arrivals,
`replica` wraps one engine, `routers` are the rules compared, `sim` is the event loop, `command` the CLI and
`report` the tables and plots."""
