"""Filter expressions: the typed tree of a filter DataFusion pushes, what the read path asks of it
(conjuncts, key points, region predicates), its Lance SQL form, and the SQL predicate text memwal_df's
SQL functions take. Imports nothing of the read path."""
