"""A run's life in its ``output_dir``: where it lives and who holds it (``output_dir``, ``lock``), where it starts
and what may change on resume (``resume``), its plan and save schedule (``plan``), what a step checkpoint holds
(``step_content``, ``recipe_state``) and the savers that write and commit it (``savers``, ``sharded_saver``), the
step directories and their retention (``step_dirs``), its metrics log and preemption, and runs kept in an object
store (``object_store``, ``store_run``)."""
