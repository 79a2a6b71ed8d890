from serving.launch import main

main()
