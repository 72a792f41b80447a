from sglang_pdd.router.front.cli import main

main()
