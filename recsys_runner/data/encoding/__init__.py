"""How raw columns become the model's inputs, as state that travels with the model: fitting (:mod:`.fit`; the columns'
roles, when a config lists none, :mod:`.roles`), the fitted document stored in every checkpoint (:mod:`.stored`),
vocabularies (:mod:`.vocabulary`), the row encoder shared by training and serving (:mod:`.rows`) and the served model's
loader (:mod:`.served`).

:mod:`.rows`, :mod:`.vocabulary` and :mod:`.served` import NumPy, PyArrow (and, to run the program, torch and pandas)
only: the MLflow model ``export`` writes carries copies of them, so serving needs no recsys_runner."""
