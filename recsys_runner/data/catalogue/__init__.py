"""Items for retrieval: the item catalogue (every item once, with the item tower's features), its files, and sampled
negatives drawn from it inside the data pipeline."""
