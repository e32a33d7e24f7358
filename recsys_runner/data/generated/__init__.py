"""Generated data: deterministic synthetic clicks, item catalogues and user histories whose labels depend on the features
(the default data of every model), and files in public datasets' layouts for tests and benchmarks."""
