from sglang_pdd.router.app import main

main()
