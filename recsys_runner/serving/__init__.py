"""What ``export`` writes for a server: the model as ``torch.export`` programs over plain tensors (:mod:`.program`), and
the MLflow model that takes raw rows and returns ``predict``'s scores without recsys_runner (:mod:`.mlflow_model`)."""
