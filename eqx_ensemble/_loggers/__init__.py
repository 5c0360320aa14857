"""Loggers: where a `fit` run's record goes (`CSVLogger`, `TensorBoardLogger`,
`WandbLogger`), written between dispatches on a thread of their own."""
