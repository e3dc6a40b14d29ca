"""The execution engine, the plain reference: the padded LM pass, the cross-request LM scheduler, the vision encoder
(official preprocessing, the eager tower pass) and the vision-only worker. The accelerated plug-in
(``retrieval/plugins/accelerated/``) layers packed and graphed passes on it through the hooks marked in each."""
