"""How raw columns become the model's inputs, as state that travels with the model: fitting (:mod:`.fit`; the columns'
roles, when a config lists none, :mod:`.roles`), the fitted document stored in every checkpoint (:mod:`.stored`),
vocabularies (:mod:`.vocabulary`), the row encoder shared by training and serving (:mod:`.rows`; its labels and dense
features, :mod:`.number_columns`; the sparse columns' ids, :mod:`.sparse_ids`; a weighted entry's weights,
:mod:`.sparse_weights`; the blocks of rows it makes, :mod:`.encoded_rows`; the histories it completes, :mod:`.histories`;
the per-value rules it shares with fitting, :mod:`.values`; the keys of values, :mod:`.keys`) and the served model's
loader (:mod:`.served`; the program it runs, :mod:`.served_program`; a request's columns, :mod:`.served_request`; small
requests, :mod:`.served_small`).

:mod:`.keys`, :mod:`.values`, :mod:`.histories`, :mod:`.number_columns`, :mod:`.sparse_ids`, :mod:`.sparse_weights`,
:mod:`.encoded_rows`, :mod:`.rows`, :mod:`.vocabulary` and the ``served`` modules import NumPy, PyArrow (and, to run the
program, torch and pandas) only: the MLflow model ``export`` writes carries copies of them (:data:`.served.SHIPPED`), so serving needs no
recsys_runner."""
